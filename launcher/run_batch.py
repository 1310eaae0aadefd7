"""`meshserve run-batch -i IN -o OUT`: a Batch API input file (OpenAI's JSONL, as vLLM's
run-batch takes it) answered offline, by the serving stack itself: the server starts on
loopback addresses with the Batch API on a private directory, runs one job per endpoint
the file names, writes every answer line (OpenAI's output format, errors included) to OUT,
and stops. Any parallelism `serve` takes, run-batch takes."""

from __future__ import annotations

import io
import json
import logging
import shutil
import sys
import tempfile
import threading
from pathlib import Path

from tqdm import tqdm

from meshserve.engine.engine import Engine
from meshserve.engine.serving.batch.jobs import UNFINISHED
from meshserve.engine.serving.openai_protocol import OpenAIError
from meshserve.engine.serving.response_store import owner_of
from meshserve.launcher.serve import ServeMode

log = logging.getLogger("meshserve")

POLL_S = 0.2
OWNER = owner_of(None)


def private_settings() -> tuple[list[str], Path]:
    """The settings that make the server run-batch's alone, and the directory they name
    (removed once the run ends)."""
    workdir = Path(tempfile.mkdtemp(prefix="meshserve-run-batch-"))
    return ["server.http=127.0.0.1:0", "server.zmq=tcp://127.0.0.1:0", f"server.batch.data_dir={workdir}"], workdir


def split_by_endpoint(data: bytes) -> dict[str, bytes]:
    """The input's lines grouped by their `url` (one job each), in order; a line that is not
    a JSON object with a string url goes with the first group, whose validation names it."""
    groups: dict[str, list[bytes]] = {}
    for raw in data.splitlines():
        if not raw.strip():
            continue
        try:
            url = json.loads(raw).get("url")
        except (ValueError, AttributeError):
            url = None
        groups.setdefault(url if isinstance(url, str) else "", []).append(raw)
    if "" in groups and len(groups) > 1:  # the malformed lines fail the first real group
        first = next(k for k in groups if k)
        groups[first] += groups.pop("")
    return {url or "/v1/chat/completions": b"\n".join(lines) + b"\n" for url, lines in groups.items()}


class RunBatchMode(ServeMode):
    def __init__(self, input_path: str, output_path: str, workdir: Path | None, drain_timeout: float = 30.0):
        super().__init__(drain_timeout)
        self.input, self.output, self.workdir = Path(input_path), Path(output_path), workdir
        self.failed = False

    def started(self, server) -> None:
        """Queue the jobs, and stop the server once they end."""
        api = self.frontends.http.batch
        try:
            jobs = []
            for endpoint, data in split_by_endpoint(self.input.read_bytes()).items():
                record = api.files.create(OWNER, self.input.name, "batch", io.BytesIO(data))
                jobs.append(api.submit(OWNER, record.id, endpoint).id)
        except OpenAIError as e:
            print(f"meshserve run-batch: {e.message}", file=sys.stderr)
            self.failed = True
            server.request_stop()
            return
        threading.Thread(target=self._watch, args=(api, jobs, server), name="meshserve-run-batch",
                         daemon=True).start()

    def _watch(self, api, job_ids: list[str], server) -> None:
        stop = threading.Event()
        with tqdm(desc="requests", unit="req", file=sys.stderr) as bar:
            while not stop.wait(POLL_S):
                jobs = [api.jobs.get(OWNER, i) for i in job_ids]
                counts = [j.request_counts for j in jobs]
                bar.total = sum(c.total for c in counts) or None
                bar.n = sum(c.completed + c.failed for c in counts)
                bar.refresh()
                if all(j.status not in UNFINISHED for j in jobs):
                    break
        self._write(api, jobs)
        server.request_stop()

    def _write(self, api, jobs) -> None:
        """Every answer line of `jobs` into OUT; a job that failed whole says why."""
        with open(self.output, "wb") as out:
            for job in jobs:
                for file_id in (job.output_file_id, job.error_file_id):
                    if file_id is not None:
                        out.write(api.files.path(file_id).read_bytes())
                for error in job.errors or []:
                    self.failed = True
                    print(f"meshserve run-batch: {job.endpoint}: {error['message']}", file=sys.stderr)
        done = sum(j.request_counts.completed for j in jobs)
        failed = sum(j.request_counts.failed for j in jobs)
        print(f"meshserve run-batch: {done} completed, {failed} failed; wrote {self.output}", file=sys.stderr)

    def run(self, engine: Engine) -> int:
        try:
            code = super().run(engine)
        finally:
            if self.workdir is not None:
                shutil.rmtree(self.workdir, ignore_errors=True)
        return 1 if self.failed else code

