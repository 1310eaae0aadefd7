"""Batch jobs on disk: each job's record (OpenAI's Batch object and its owner), and the
journal of its finished requests, one JSON line each in its output or its error file.

A line is appended and synced before the request counts as done, so after a crash the
journal says exactly which requests finished: a last line the crash cut short is cut off
(its request runs again), and no request with a whole line runs again.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Literal

import msgspec

from .files import write_atomically

Status = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                 "cancelled"]
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
WINDOWS = {"24h": 24 * 3600}
"""completion_window values taken, in seconds (OpenAI's only one)."""


class RequestCounts(msgspec.Struct):
    total: int = 0
    completed: int = 0
    failed: int = 0


class JobRecord(msgspec.Struct):
    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: Status = "validating"
    metadata: dict[str, str] | None = None
    errors: list[dict[str, Any]] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)

    def public(self) -> dict[str, Any]:
        """OpenAI's Batch object."""
        out = msgspec.to_builtins(self)
        del out["owner"]
        errors = out.pop("errors")
        return out | {"object": "batch", "errors": None if errors is None else {"object": "list", "data": errors}}

    def mark(self, status: Status) -> None:
        """Move to `status`, stamping its time."""
        self.status = status
        stamp = {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
                 "failed": "failed_at", "expired": "expired_at", "cancelling": "cancelling_at",
                 "cancelled": "cancelled_at"}.get(status)
        if stamp is not None:
            setattr(self, stamp, int(time.time()))


class Journal:
    """A job's output or error lines: appended and synced one at a time (from any thread)."""

    def __init__(self, path: Path):
        self.path = path
        self.done = recover(path)
        """custom_id of each request with a whole line here."""
        self._file = open(path, "ab")
        self._lock = threading.Lock()

    def append(self, custom_id: str, line: dict[str, Any]) -> None:
        data = msgspec.json.encode(line) + b"\n"
        with self._lock:
            self._file.write(data)
            self._file.flush()
            os.fsync(self._file.fileno())
            self.done.add(custom_id)

    def close(self) -> None:
        self._file.close()


def recover(path: Path) -> set[str]:
    """The custom_ids of the whole lines at `path` (created empty if missing); a last line
    without its newline, which a crash cut short, is cut off."""
    if not path.exists():
        path.touch()
        return set()
    data = path.read_bytes()
    whole = data[:data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        with open(path, "r+b") as f:
            f.truncate(len(whole))
    return {msgspec.json.decode(line)["custom_id"] for line in whole.splitlines() if line}


class JobStore:
    """Every job's record (`<id>.json`) and journals (`<id>.output.jsonl`, `<id>.errors.jsonl`)."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.jobs: dict[str, JobRecord] = {}
        for meta in root.glob("batch_*.json"):
            job = msgspec.json.decode(meta.read_bytes(), type=JobRecord)
            self.jobs[job.id] = job

    def save(self, job: JobRecord) -> None:
        write_atomically(self.root / f"{job.id}.json", msgspec.json.encode(job))
        with self._lock:
            self.jobs[job.id] = job

    def get(self, owner: str, job_id: str) -> JobRecord | None:
        job = self.jobs.get(job_id)
        return job if job is not None and job.owner == owner else None

    def _all(self) -> list[JobRecord]:
        with self._lock:  # jobs are added from other threads (`meshserve run-batch`'s)
            return list(self.jobs.values())

    def list(self, owner: str) -> list[JobRecord]:
        """`owner`'s jobs, newest first."""
        mine = [j for j in self._all() if j.owner == owner]
        return sorted(mine, key=lambda j: (j.created_at, j.id), reverse=True)

    def unfinished(self) -> list[JobRecord]:
        """Jobs to run or resume, oldest first."""
        return sorted((j for j in self._all() if j.status in UNFINISHED), key=lambda j: (j.created_at, j.id))

    def journal(self, job: JobRecord, kind: Literal["output", "errors"]) -> Journal:
        return Journal(self.root / f"{job.id}.{kind}.jsonl")

    def journal_path(self, job: JobRecord, kind: Literal["output", "errors"]) -> Path:
        return self.root / f"{job.id}.{kind}.jsonl"
