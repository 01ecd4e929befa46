"""Input discovery, the streaming readers and the tokenizers of ``flashcp pack``."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flashcp.data.readers import DOC, SKIP_REASONS, discover_inputs, iter_records
from flashcp.errors import FlashcpError


def write_jsonl(path: Path, lines: list) -> Path:
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else json.dumps(line).encode())
            f.write(b"\n")
    return path


def reason(kind: int) -> str:
    return "doc" if kind == DOC else SKIP_REASONS[kind - 1]


def test_folder_order_formats_include_exclude_and_hidden(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("z")
    (tmp_path / "a.jsonl").write_text("")
    (tmp_path / "b" / "c.py").write_text("print()")
    (tmp_path / "b" / "skip").mkdir()
    (tmp_path / "b" / "skip" / "x.txt").write_text("x")
    (tmp_path / ".hidden.txt").write_text("h")
    (tmp_path / "notes.md").write_text("m")
    skipped = Counter()
    inputs, warnings = discover_inputs([str(tmp_path)], include=("*.py",), exclude=("skip",), skipped=skipped)
    assert [p.path.relative_to(tmp_path).as_posix() for p in inputs] == ["a.jsonl", "b/c.py", "b/z.txt"]
    assert [p.format for p in inputs] == ["jsonl", "text", "text"]
    assert warnings == [] and skipped == {".md": 1}  # neither hidden nor excluded files are counted
    again, warnings = discover_inputs([str(tmp_path / "a.jsonl"), str(tmp_path / "*.jsonl")])
    assert len(again) == 1 and "more than once" in warnings[0]


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing.jsonl", "does not exist"),
    (lambda d: (d / "x.md").write_text("x") and d / "x.md", "add --include"),
    (lambda d: (d / "empty").mkdir() or d / "empty", "holds no"),
    (lambda d: d / "*.nothing", "matches no"),
])
def test_discovery_errors(tmp_path, make, message):
    with pytest.raises(FlashcpError, match=message):
        discover_inputs([str(make(tmp_path))])


def test_jsonl_records_count_every_kind_of_bad_line(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [
        {"text": "one"}, b"{not json", {"other": 1}, {"text": None}, {"text": 5}, b"[1, 2]",
        b'{"text": "caf\xff"}', b'{"text": "\\ud800"}', b"", {"text": ""}, {"text": "two"},
    ])
    inputs, _ = discover_inputs([str(path)])
    records = list(iter_records(inputs))
    assert [(r[1], reason(r[2]), r[3]) for r in records] == [
        (0, "doc", "one"), (1, "invalid_json", None), (2, "missing_field", None),
        (3, "missing_field", None), (4, "not_text", None), (5, "invalid_json", None),
        (6, "invalid_utf8", None), (7, "invalid_utf8", None), (9, "doc", ""), (10, "doc", "two")]
    assert [r[3] for r in iter_records(inputs, start=(0, 9))] == ["", "two"]
    with pytest.raises(FlashcpError, match="line 2 is not a JSON object"):
        list(iter_records(inputs, strict=True))


def test_gzip_parquet_text_and_resume_positions(tmp_path):
    with gzip.open(tmp_path / "a.jsonl.gz", "wb") as f:
        f.write(b'{"body": "g0"}\n{"body": "g1"}\n')
    table = pa.table({"body": pa.array([b"p0", None, b"\xfe", b"p3"] * 700, pa.binary())})
    pq.write_table(table, tmp_path / "b.parquet", row_group_size=500)
    (tmp_path / "c.txt").write_bytes("naïve".encode())
    (tmp_path / "d.txt").write_bytes(b"\xff\xfe")
    inputs, _ = discover_inputs([str(tmp_path)])
    assert [i.format for i in inputs] == ["jsonl.gz", "parquet", "text", "text"]
    records = list(iter_records(inputs, text_field="body"))
    assert records[:2] == [(0, 0, DOC, "g0"), (0, 1, DOC, "g1")]
    parquet = [r for r in records if r[0] == 1]
    assert [r[1] for r in parquet] == list(range(2800))
    assert [reason(r[2]) for r in parquet[:4]] == ["doc", "missing_field", "invalid_utf8", "doc"]
    assert records[-2:] == [(2, 0, DOC, "naïve"), (3, 0, SKIP_REASONS.index("invalid_utf8") + 1, None)]
    resumed = list(iter_records(inputs, text_field="body", start=(1, 1203)))
    assert resumed == records[2 + 1203:]


def test_unreadable_inputs(tmp_path):
    (tmp_path / "bad.jsonl.gz").write_bytes(b"this is not gzip\n")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 nope")
    pq.write_table(pa.table({"x": [1]}), tmp_path / "int.parquet")
    for name, message in [("bad.jsonl.gz", "not a readable gzip"), ("bad.parquet", "not a readable Parquet"),
                          ("int.parquet", "has no column 'text'")]:
        inputs, _ = discover_inputs([str(tmp_path / name)])
        with pytest.raises(FlashcpError, match=message):
            list(iter_records(inputs))


