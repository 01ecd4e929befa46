"""Safe file operations (flashcp.fileio): a failed atomic write leaves what was there, names stay plain."""

import hashlib
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flashcp.errors import FlashcpError
from flashcp.fileio import atomic_path, check_plain_name, sha256_file, write_json_atomic, write_parquet_atomic


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "report.json"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("disk full")
    assert target.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["report.json"]

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)  # the rename itself fails
    with pytest.raises(OSError):
        write_json_atomic(target, {"a": 1})
    assert target.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["report.json"]


def test_atomic_writes_land_whole(tmp_path):
    write_json_atomic(tmp_path / "a" / "b.json", {"x": [1, 2]})
    assert json.loads((tmp_path / "a" / "b.json").read_text()) == {"x": [1, 2]}
    with pytest.raises(ValueError):
        write_json_atomic(tmp_path / "nan.json", {"x": float("nan")}, strict=True)
    assert not (tmp_path / "nan.json").exists()
    table = pa.table({"v": list(range(10))})
    write_parquet_atomic(tmp_path / "t.parquet", table, 4)
    assert pq.ParquetFile(tmp_path / "t.parquet").num_row_groups == 3
    write_parquet_atomic(tmp_path / "u.parquet", table, 4)
    assert sha256_file(tmp_path / "t.parquet") == sha256_file(tmp_path / "u.parquet")  # bytes: the table's alone


def test_sha256_file_reads_in_chunks(tmp_path):
    data = os.urandom(10_000)
    (tmp_path / "f").write_bytes(data)
    assert sha256_file(tmp_path / "f", chunk_bytes=999) == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", ".hidden", "tab\tname", "x" * 201])
def test_only_plain_names_pass(name):
    with pytest.raises(FlashcpError, match="plain folder name"):
        check_plain_name(name, "plan name")


def test_plain_names_pass():
    for name in ("cp8-flashcp2", "cp8-flashcp+", "my_plan.v2"):
        assert check_plain_name(name, "plan name") == name
