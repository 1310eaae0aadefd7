"""OpenAI's Batch API: `/v1/files` and `/v1/batches`, and the runner that feeds a job's
requests to the engine below every online request.

    files = FileStore(data_dir / "files", max_file_bytes, max_files)    # files.py
    jobs = JobStore(data_dir / "batches")                                # jobs.py
    runner = BatchRunner(jobs, files, execute, max_in_flight, max_requests)  # runner.py
    api = BatchApi(files, jobs, runner, ...)                             # api.py: the routes' handlers

Everything a job needs to resume lives on disk: its record (status, counts), and the
output and error lines written so far, one line per finished request, appended and synced
before it counts. A server killed mid-job finds, at its next start, which requests have a
line and runs the others: none twice into the output, none lost.
"""

from .api import BatchApi
from .files import FileStore
from .jobs import JobStore
from .runner import BatchRunner

__all__ = ["BatchApi", "BatchRunner", "FileStore", "JobStore"]
