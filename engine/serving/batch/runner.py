"""Runs the batch jobs, oldest first: each job's input checked whole (a bad line fails the
job before anything runs, as OpenAI's validation does), then its requests handed to the
engine as background requests (engine/scheduler.py: below every online request, preempted
first), at most max_in_flight at once, and each answer journaled (jobs.py) as it comes.

A request the server cannot take now (429: too much waits) is retried; one it refuses
because it is stopping (503) is left for the next start, unjournaled, and the job with it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .files import FileStore
from .jobs import JobRecord, JobStore, Journal

log = logging.getLogger("meshserve.engine.serving.batch")

Execute = Callable[[str, bytes], Awaitable[tuple[int, dict[str, Any]]]]
"""Runs one request as a background request: (url, JSON body) -> (HTTP status, JSON body)."""
RETRY_AFTER = 0.5
"""Seconds before a request the server had no room for is sent again."""
SAVE_EVERY = 1.0
"""Seconds between saves of a running job's counts (its journals are the truth; the record
only shows progress)."""
MAX_REPORTED = 10
"""Validation errors reported per job."""


@dataclass(frozen=True)
class Line:
    custom_id: str
    url: str
    body: bytes


class InvalidInput(Exception):
    def __init__(self, errors: list[dict[str, Any]]):
        super().__init__(errors[0]["message"])
        self.errors = errors


def read_input(data: bytes, endpoint: str, max_requests: int) -> list[Line]:
    """A job's input lines; InvalidInput (the first MAX_REPORTED problems) if any is wrong."""
    errors: list[dict[str, Any]] = []
    lines: list[Line] = []
    seen: set[str] = set()

    def bad(number: int, message: str, param: str | None = None) -> None:
        if len(errors) < MAX_REPORTED:
            errors.append({"code": "invalid_request", "message": message, "param": param, "line": number})

    for number, raw in enumerate(data.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except ValueError as e:
            bad(number, f"line {number} is not JSON: {e}")
            continue
        if not isinstance(item, dict):
            bad(number, f"line {number} is not a JSON object")
            continue
        custom_id, method, url, body = (item.get(k) for k in ("custom_id", "method", "url", "body"))
        if not isinstance(custom_id, str) or not custom_id:
            bad(number, f"line {number}: custom_id must be a non-empty string", "custom_id")
        elif custom_id in seen:
            bad(number, f"line {number}: custom_id {custom_id[:64]!r} is not unique in the file", "custom_id")
        elif method != "POST":
            bad(number, f"line {number}: method must be POST, got {str(method)[:16]!r}", "method")
        elif url != endpoint:
            bad(number, f"line {number}: url {str(url)[:64]!r} is not the job's endpoint {endpoint}", "url")
        elif not isinstance(body, dict):
            bad(number, f"line {number}: body must be a JSON object", "body")
        else:
            seen.add(custom_id)
            lines.append(Line(custom_id, url, json.dumps(body).encode()))
    if not errors and not lines:
        bad(0, "the input file has no requests")
    if len(lines) > max_requests:
        bad(0, f"the input file has {len(lines)} requests; a job takes at most {max_requests} "
               f"(server.batch.max_requests)")
    if errors:
        raise InvalidInput(errors)
    return lines


class BatchRunner:
    def __init__(self, jobs: JobStore, files: FileStore, execute: Execute, max_in_flight: int, max_requests: int,
                 accepting: Callable[[], bool]):
        """`accepting`: whether the server still takes requests (false once it drains)."""
        self.jobs, self.files, self.execute = jobs, files, execute
        self.max_in_flight, self.max_requests, self.accepting = max_in_flight, max_requests, accepting
        self.in_flight = 0
        self.num_completed = 0
        self.num_failed = 0
        """Requests answered since the start (completed: 200; failed: an error line)."""
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._running: dict[str, set[asyncio.Task]] = {}
        """Per job, its requests in the engine now."""

    @property
    def num_queued(self) -> int:
        """Requests of unfinished jobs not yet answered nor handed to the engine."""
        return sum(max(0, j.request_counts.total - j.request_counts.completed - j.request_counts.failed)
                   for j in self.jobs.unfinished()) - self.in_flight

    def start(self) -> None:
        """Run the jobs on the running event loop, those a previous run left first."""
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def poke(self) -> None:
        """A job was created."""
        if self._wake is not None:
            self._wake.set()

    def cancel(self, job_id: str) -> None:
        """The job was marked cancelling: its requests in the engine are aborted (they get no
        line), and it ends with what it journaled."""
        for task in self._running.get(job_id, ()):
            task.cancel()
        self.poke()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            job = next(iter(self.jobs.unfinished()), None) if self.accepting() else None
            if job is None:
                await self._wake.wait()
                continue
            try:
                finished = await self._job(job)
            except Exception:  # noqa: BLE001 - one job's failure must not stop the others
                log.exception("batch %s failed", job.id)
                job.errors = [{"code": "internal_error", "message": "the job failed (the server log has the details)",
                               "param": None, "line": None}]
                job.mark("failed")
                self.jobs.save(job)
                continue
            if not finished:  # the server is stopping: the job resumes at the next start
                await self._wake.wait()

    async def _job(self, job: JobRecord) -> bool:
        """Run `job` to its end; False if the server stopped taking requests first."""
        try:
            lines = read_input(self.files.path(job.input_file_id).read_bytes(), job.endpoint, self.max_requests)
        except InvalidInput as e:
            job.errors = e.errors
            job.mark("failed")
            self.jobs.save(job)
            return True
        except FileNotFoundError:
            job.errors = [{"code": "invalid_request", "message": f"the input file {job.input_file_id} is gone",
                           "param": "input_file_id", "line": None}]
            job.mark("failed")
            self.jobs.save(job)
            return True
        if job.status == "validating":
            job.request_counts.total = len(lines)
            job.mark("in_progress")
        output, errors = self.jobs.journal(job, "output"), self.jobs.journal(job, "errors")
        try:
            job.request_counts.completed, job.request_counts.failed = len(output.done), len(errors.done)
            self.jobs.save(job)
            if job.status == "in_progress":
                done = output.done | errors.done
                if not await self._feed(job, [line for line in lines if line.custom_id not in done], output, errors):
                    self.jobs.save(job)
                    return False
        finally:
            output.close()
            errors.close()
        self._finish(job)
        return True

    async def _feed(self, job: JobRecord, pending: list[Line], output: Journal, errors: Journal) -> bool:
        """Hand `pending` to the engine, max_in_flight at a time, until done, cancelled or
        expired; False if the server stopped taking requests."""
        tasks = self._running[job.id] = set()
        stopped = False
        saved = time.monotonic()
        for index, line in enumerate(pending):
            while len(tasks) >= self.max_in_flight:
                finished, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                tasks -= finished
                stopped |= not all(t.cancelled() or t.result() for t in finished)
            if time.monotonic() - saved > SAVE_EVERY:  # off the event loop: a save syncs the disk
                await asyncio.to_thread(self.jobs.save, job)
                saved = time.monotonic()
            if stopped or job.status == "cancelling":
                break
            if time.time() >= job.expires_at:
                for late in pending[index:]:
                    await self._journal(job, errors, late, None, {"code": "batch_expired", "message":
                                        "the job's completion window ended before this request ran"})
                job.mark("expired")
                break
            tasks.add(asyncio.get_running_loop().create_task(self._one(job, line, output, errors)))
        if tasks:  # a cancelled request (the job was cancelled) stops nothing
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            stopped |= not all(isinstance(o, asyncio.CancelledError) or o is True for o in outcomes)
        del self._running[job.id]
        return not stopped

    async def _one(self, job: JobRecord, line: Line, output: Journal, errors: Journal) -> bool:
        """One request, journaled; False if the server is stopping (nothing journaled)."""
        self.in_flight += 1
        try:
            while True:
                try:
                    status, body = await self.execute(line.url, line.body)
                except Exception:  # noqa: BLE001 - journaled as this request's failure
                    log.exception("batch %s: request %s failed", job.id, line.custom_id)
                    status, body = 500, {"error": {"message": "internal error (the server log has the details)",
                                                   "type": "server_error", "code": "internal_error"}}
                if status == 429:
                    await asyncio.sleep(RETRY_AFTER)
                    continue
                if status == 503 or not self.accepting():
                    return False
                break
        finally:
            self.in_flight -= 1
        await self._journal(job, output if status == 200 else errors, line,
                            {"status_code": status, "request_id": body.get("id") or uuid.uuid4().hex, "body": body},
                            None)
        return True

    async def _journal(self, job: JobRecord, journal: Journal, line: Line, response: dict | None,
                       error: dict | None) -> None:
        """One answer into its journal, synced (on a thread: the event loop serves online
        requests meanwhile), then counted."""
        await asyncio.to_thread(journal.append, line.custom_id, {
            "id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id, "response": response, "error": error})
        if response is not None and response["status_code"] == 200:
            job.request_counts.completed += 1
            self.num_completed += 1
        else:
            job.request_counts.failed += 1
            self.num_failed += 1

    def _finish(self, job: JobRecord) -> None:
        """The job's journals as its output and error files; then its last status."""
        if job.status == "in_progress":
            job.mark("finalizing")
            self.jobs.save(job)
        for kind, attr in (("output", "output_file_id"), ("errors", "error_file_id")):
            path = self.jobs.journal_path(job, kind)
            if getattr(job, attr) is None and path.exists() and path.stat().st_size:
                record = self.files.adopt(job.owner, f"{job.id}_{kind}.jsonl", "batch_output", path)
                setattr(job, attr, record.id)
        job.mark({"finalizing": "completed", "cancelling": "cancelled"}.get(job.status, job.status))
        self.jobs.save(job)
        log.info("batch %s %s: %d completed, %d failed of %d", job.id, job.status, job.request_counts.completed,
                 job.request_counts.failed, job.request_counts.total)
