"""The handlers of `/v1/files` and `/v1/batches` (OpenAI's Files and Batch APIs), each
caller seeing only what its API key made (response_store.owner_of)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from meshserve.engine.serving.openai_protocol import OpenAIError
from meshserve.engine.serving.request_body import parse_body
from meshserve.engine.serving.response_store import owner_of

from .files import FileError, FileStore
from .jobs import WINDOWS, JobRecord, JobStore
from .runner import BatchRunner

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
"""The endpoints a job's requests may go to."""
MAX_LIST = 10_000


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str = Field(max_length=128)
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


def _owner(raw: Request) -> str:
    return owner_of(raw.headers.get("authorization") or raw.headers.get("x-api-key"))


def _page(items: list[dict[str, Any]], raw: Request) -> dict[str, Any]:
    """A list page: the items after `after` (an id), at most `limit`."""
    after, limit = raw.query_params.get("after"), raw.query_params.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= MAX_LIST:
        raise OpenAIError(400, f"limit must be an integer from 1 to {MAX_LIST}", param="limit", code="invalid_value")
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:int(limit)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}


class BatchApi:
    def __init__(self, files: FileStore, jobs: JobStore, runner: BatchRunner, max_model_len: int):
        self.files, self.jobs, self.runner, self.max_model_len = files, jobs, runner, max_model_len

    # ------------------------------------------------------------------ files

    async def upload(self, raw: Request) -> JSONResponse:
        form = await raw.form(max_files=1, max_fields=8, max_part_size=1 << 20)
        upload, purpose = form.get("file"), form.get("purpose")
        if upload is None or isinstance(upload, str):
            raise OpenAIError(400, "a multipart form with the file in the field `file` is needed", param="file",
                              code="invalid_value")
        if purpose != "batch":
            raise OpenAIError(400, f"purpose {str(purpose)[:40]!r}: this server keeps files for purpose `batch` only",
                              param="purpose", code="invalid_value")
        try:
            record = await asyncio.to_thread(self.files.create, _owner(raw), upload.filename or "upload.jsonl",
                                             purpose, upload.file)
        except FileError as e:
            raise OpenAIError(e.status, e.message, param=e.param, code="invalid_value") from None
        finally:
            await upload.close()
        return JSONResponse(record.public())

    def _file(self, raw: Request, file_id: str):
        record = self.files.get(_owner(raw), file_id)
        if record is None:
            raise OpenAIError(404, f"No such File object: {file_id}", param="id", code="not_found")
        return record

    def list_files(self, raw: Request) -> dict[str, Any]:
        records = self.files.list(_owner(raw), raw.query_params.get("purpose"))
        if raw.query_params.get("order") == "asc":
            records.reverse()
        return _page([r.public() for r in records], raw)

    def retrieve_file(self, raw: Request, file_id: str) -> dict[str, Any]:
        return self._file(raw, file_id).public()

    def file_content(self, raw: Request, file_id: str) -> FileResponse:
        record = self._file(raw, file_id)
        return FileResponse(self.files.path(record.id), media_type="application/jsonl", filename=record.filename)

    def delete_file(self, raw: Request, file_id: str) -> dict[str, Any]:
        if any(j.input_file_id == file_id and j.status in ("validating", "in_progress", "finalizing", "cancelling")
               for j in self.jobs.list(_owner(raw))):
            raise OpenAIError(409, f"file {file_id} is the input of a batch still running", param="id",
                              code="conflict")
        if not self.files.delete(_owner(raw), file_id):
            raise OpenAIError(404, f"No such File object: {file_id}", param="id", code="not_found")
        return {"id": file_id, "object": "file", "deleted": True}

    # ------------------------------------------------------------------ batches

    async def create(self, raw: Request) -> dict[str, Any]:
        req = parse_body(await raw.body(), CreateBatch, self.max_model_len)
        return self.submit(_owner(raw), req.input_file_id, req.endpoint, req.completion_window, req.metadata).public()

    def submit(self, owner: str, input_file_id: str, endpoint: str, completion_window: str = "24h",
               metadata: dict[str, str] | None = None) -> JobRecord:
        """A new job of `owner`'s file `input_file_id`, queued for the runner; OpenAIError
        (400) naming what is wrong."""
        if endpoint not in ENDPOINTS:
            raise OpenAIError(400, f"endpoint {endpoint[:64]!r}: a batch's requests go to one of "
                                   f"{', '.join(ENDPOINTS)}", param="endpoint", code="invalid_value")
        window = WINDOWS.get(completion_window)
        if window is None:
            raise OpenAIError(400, f"completion_window must be one of {', '.join(WINDOWS)}",
                              param="completion_window", code="invalid_value")
        source = self.files.get(owner, input_file_id)
        if source is None or source.purpose != "batch":
            raise OpenAIError(400, f"input_file_id {input_file_id!r} is no file of purpose batch of this API key",
                              param="input_file_id", code="invalid_value")
        now = int(time.time())
        job = JobRecord("batch_" + uuid.uuid4().hex, owner, endpoint, source.id, completion_window, now,
                        now + window, metadata=metadata)
        self.jobs.save(job)
        self.runner.poke()
        return job

    def _job(self, raw: Request, batch_id: str) -> JobRecord:
        job = self.jobs.get(_owner(raw), batch_id)
        if job is None:
            raise OpenAIError(404, f"No such Batch object: {batch_id}", param="batch_id", code="not_found")
        return job

    def retrieve(self, raw: Request, batch_id: str) -> dict[str, Any]:
        return self._job(raw, batch_id).public()

    def list(self, raw: Request) -> dict[str, Any]:
        return _page([j.public() for j in self.jobs.list(_owner(raw))], raw)

    def cancel(self, raw: Request, batch_id: str) -> dict[str, Any]:
        """Stop the job: no more of its requests go to the engine, those there are aborted,
        and it ends `cancelled` with the answers it had in its files."""
        job = self._job(raw, batch_id)
        if job.status in ("validating", "in_progress"):
            job.mark("cancelling")
            self.jobs.save(job)
            self.runner.cancel(job.id)
        elif job.status != "cancelling":
            raise OpenAIError(409, f"Cannot cancel a batch with status {job.status}", param="batch_id",
                              code="conflict")
        return job.public()
