"""The Batch API's storage (engine/serving/batch): a job's journal after a crash keeps its whole
lines and cuts a torn last one; the input's checks name the line; files are bounded, per API
key, and survive a restart of the store; job records too."""

from __future__ import annotations

import io
import json

import pytest

from meshserve.engine.serving.batch.files import FileError, FileStore
from meshserve.engine.serving.batch.jobs import JobRecord, JobStore, recover
from meshserve.engine.serving.batch.runner import InvalidInput, read_input


def test_a_torn_last_line_is_cut_and_its_request_counts_as_not_done(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"custom_id": "a", "response": {}}\n{"custom_id": "b", "response": {}}\n{"custom_id": "c", "re')
    assert recover(path) == {"a", "b"}
    assert path.read_bytes().endswith(b'"b", "response": {}}\n')
    assert recover(tmp_path / "new.jsonl") == set() and (tmp_path / "new.jsonl").exists()


def test_a_journal_appends_whole_lines_that_a_new_journal_reads_back(tmp_path):
    store = JobStore(tmp_path)
    job = JobRecord("batch_1", "me", "/v1/completions", "file-1", "24h", 0, 10)
    journal = store.journal(job, "output")
    journal.append("x", {"custom_id": "x", "response": {"status_code": 200}})
    journal.append("y", {"custom_id": "y", "response": {"status_code": 200}})
    journal.close()
    assert store.journal(job, "output").done == {"x", "y"}
    store.save(job)
    again = JobStore(tmp_path)
    assert again.get("me", "batch_1") == job and again.get("you", "batch_1") is None
    assert [j.id for j in again.unfinished()] == ["batch_1"]


def line(**fields) -> bytes:
    item = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}} | fields
    return json.dumps(item).encode()


@pytest.mark.parametrize("data, number, fragment", [
    (line() + b"\n" + line(), 2, "not unique"),
    (line() + b"\nnot json", 2, "not JSON"),
    (line(url="/v1/chat/completions"), 1, "endpoint"),
    (line(method="GET"), 1, "POST"),
    (line(body=[1]), 1, "body"),
    (line(custom_id=""), 1, "custom_id"),
    (b"\n\n", 0, "no requests"),
])
def test_a_bad_input_line_is_named(data, number, fragment):
    with pytest.raises(InvalidInput) as e:
        read_input(data, "/v1/completions", 100)
    assert e.value.errors[0]["line"] == number and fragment in e.value.errors[0]["message"]


def test_input_lines_and_the_request_limit():
    data = b"\n".join(line(custom_id=str(i)) for i in range(3))
    assert [x.custom_id for x in read_input(data, "/v1/completions", 3)] == ["0", "1", "2"]
    with pytest.raises(InvalidInput, match="at most 2"):
        read_input(data, "/v1/completions", 2)


def test_files_are_bounded_per_key_and_survive_a_restart(tmp_path):
    store = FileStore(tmp_path, max_file_bytes=10, max_files=2)
    mine = store.create("me", "a.jsonl", "batch", io.BytesIO(b"0123456789"))
    with pytest.raises(FileError) as e:
        store.create("me", "b.jsonl", "batch", io.BytesIO(b"0123456789x"))
    assert e.value.status == 413 and not list(tmp_path.glob("*.tmp"))
    store.create("me", "c.jsonl", "batch", io.BytesIO(b"1"))
    with pytest.raises(FileError, match="max_files"):
        store.create("me", "d.jsonl", "batch", io.BytesIO(b"1"))
    assert store.get("you", mine.id) is None and store.list("you") == []
    again = FileStore(tmp_path, max_file_bytes=10, max_files=2)
    assert again.get("me", mine.id) == mine and again.path(mine.id).read_bytes() == b"0123456789"
    assert again.delete("me", mine.id) and again.get("me", mine.id) is None and not again.path(mine.id).exists()
