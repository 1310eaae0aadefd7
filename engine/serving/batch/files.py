"""The Files API's store: uploaded files (a job's JSONL input) and the files jobs write (their
output and errors), each with a record of its own, on disk and per API key.

A file is `<id>.data` beside its record `<id>.json`, both written to a temporary name and
renamed, so a file is either whole or absent. Records are read once at start and kept in
memory; the bytes stay on disk.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import BinaryIO, Literal

import msgspec

Purpose = Literal["batch", "batch_output", "user_data", "assistants", "fine-tune", "vision", "evals"]
CHUNK = 1 << 20


class FileRecord(msgspec.Struct, frozen=True):
    id: str
    owner: str
    """The digest of the API key that owns it (response_store.owner_of)."""
    bytes: int
    created_at: int
    filename: str
    purpose: str

    def public(self) -> dict:
        """OpenAI's File object."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


class FileError(Exception):
    """A file refused: `status` (400, 413, ...) and why."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def write_atomically(path: Path, data: bytes) -> None:
    """`data` at `path`, whole or not at all (a crash leaves the old file or none)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class FileStore:
    def __init__(self, root: Path, max_file_bytes: int, max_files: int):
        self.root, self.max_file_bytes, self.max_files = root, max_file_bytes, max_files
        root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._records: dict[str, FileRecord] = {}
        for meta in root.glob("*.json"):
            record = msgspec.json.decode(meta.read_bytes(), type=FileRecord)
            if self.path(record.id).exists():
                self._records[record.id] = record
        for stale in root.glob("*.tmp"):  # a write a crash cut short
            stale.unlink()

    def path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.data"

    def _all(self) -> list[FileRecord]:
        with self._lock:
            return list(self._records.values())

    def count(self, owner: str) -> int:
        return sum(r.owner == owner for r in self._all())

    def _room(self, owner: str) -> None:
        if self.count(owner) >= self.max_files:
            raise FileError(400, f"this API key keeps {self.max_files} files (server.batch.max_files); delete some "
                                 f"first", "file")

    def create(self, owner: str, filename: str, purpose: str, source: BinaryIO) -> FileRecord:
        """Store what `source` holds (read in chunks, refused past max_file_bytes)."""
        self._room(owner)
        file_id = "file-" + uuid.uuid4().hex
        tmp = self.root / f"{file_id}.data.tmp"
        size = 0
        try:
            with open(tmp, "wb") as f:
                while chunk := source.read(CHUNK):
                    size += len(chunk)
                    if size > self.max_file_bytes:
                        raise FileError(413, f"the file is larger than {self.max_file_bytes} bytes "
                                             f"(server.batch.max_file_bytes)", "file")
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            return self._register(FileRecord(file_id, owner, size, int(time.time()), filename, purpose), tmp)
        finally:
            tmp.unlink(missing_ok=True)

    def adopt(self, owner: str, filename: str, purpose: str, source: Path) -> FileRecord:
        """A file a job wrote, moved into the store (it does not count against max_files:
        a job's output is never refused)."""
        file_id = "file-" + uuid.uuid4().hex
        tmp = self.root / f"{file_id}.data.tmp"
        shutil.copyfile(source, tmp)
        return self._register(FileRecord(file_id, owner, tmp.stat().st_size, int(time.time()), filename, purpose), tmp)

    def _register(self, record: FileRecord, data: Path) -> FileRecord:
        os.replace(data, self.path(record.id))
        write_atomically(self.root / f"{record.id}.json", msgspec.json.encode(record))
        with self._lock:
            self._records[record.id] = record
        return record

    def get(self, owner: str, file_id: str) -> FileRecord | None:
        """`file_id`'s record if `owner` owns it (another key's file is as absent)."""
        record = self._records.get(file_id)
        return record if record is not None and record.owner == owner else None

    def list(self, owner: str, purpose: str | None = None) -> list[FileRecord]:
        """`owner`'s files, newest first."""
        mine = [r for r in self._all() if r.owner == owner and purpose in (None, r.purpose)]
        return sorted(mine, key=lambda r: (r.created_at, r.id), reverse=True)

    def delete(self, owner: str, file_id: str) -> bool:
        with self._lock:
            record = self.get(owner, file_id)
            if record is None:
                return False
            del self._records[file_id]
        (self.root / f"{file_id}.json").unlink(missing_ok=True)
        self.path(file_id).unlink(missing_ok=True)
        return True
