"""``flashcp pack`` end to end: format, each bad input, same bytes for any workers, resume after a kill."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import flashcp.data.pack as pack_module
from flashcp.cli import cli
from flashcp.data.dataset import DATA_SCHEMA, Dataset
from tests.cli.pack_helpers import KILLER, file_hashes

ROOT = Path(__file__).resolve().parents[2]
EOS = 256  # the byte tokenizer's


def run(*args: str):
    return CliRunner().invoke(cli, ["pack", *map(str, args)], catch_exceptions=False)


def pack(inputs, out, *extra, context_len=64):
    inputs = inputs if isinstance(inputs, list | tuple) else [inputs]
    return run(*inputs, "-o", out, "--context-len", str(context_len), "--tokenizer", "byte", "--workers", "1",
               *extra)


def write_jsonl(path: Path, docs: list, key: str = "text") -> Path:
    with open(path, "wb") as f:
        for doc in docs:
            f.write(doc if isinstance(doc, bytes) else json.dumps({key: doc}).encode())
            f.write(b"\n")
    return path


def random_docs(n: int, seed: int = 0, max_len: int = 300) -> list[str]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "délta", "ε", "zeta", "eta", "theta", "\n"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, max_len // 4))) for _ in range(n)]


def read_rows(root: Path) -> list[dict]:
    dataset = Dataset(root)
    rows = []
    for f in dataset.files:
        rows.extend(pq.read_table(dataset.path(f)).to_pylist())
    return rows


def test_output_follows_the_design(tmp_path):
    docs = random_docs(120)
    docs[3] = ""
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    result = pack(src, tmp_path / "out", "--rows-per-file", "10", "--row-group-rows", "4")
    assert result.exit_code == 0, result.output
    assert "packed" in result.output and "sequences of 64 tokens" in result.output
    root = tmp_path / "out"
    manifest = json.loads((root / "manifest.json").read_text())
    assert sorted(p.name for p in root.iterdir()) == ["data", "manifest.json"]
    assert manifest["context_len"] == 64 and manifest["has_tokens"] is True
    assert manifest["tokenizer"]["name"] == "byte" and len(manifest["tokenizer"]["sha256"]) == 64
    assert manifest["inputs"][0]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert manifest["inputs"][0]["documents"] == 120
    counts = manifest["counts"]
    assert counts["documents_read"] == 120 and counts["documents_dropped_empty"] == 1
    assert counts["documents_read"] == counts["documents_packed"] + counts["documents_dropped"]
    assert counts["tokens_read"] == counts["tokens_packed"] + counts["tokens_dropped_tail"]
    assert 0 < counts["tokens_dropped_tail"] < 64 and counts["documents_split"] > 0
    for entry in manifest["files"]:
        path = root / entry["path"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"]
        meta = pq.ParquetFile(path).metadata
        assert meta.row_group(0).column(0).compression == "ZSTD"
        assert meta.num_rows == entry["rows"] and entry["tokens"] == 64 * entry["rows"]
        assert pq.read_schema(path).remove_metadata() == DATA_SCHEMA
        groups = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        last = entry is manifest["files"][-1]
        assert groups == [4, 4, 2] or (last and groups[:-1] == [4] * (len(groups) - 1))
    assert all(f["rows"] == 10 for f in manifest["files"][:-1])
    # the sequences, read back in order, are exactly the documents' bytes plus EOS, minus the dropped tail
    expected = [list(d.encode()) + [EOS] for d in docs]
    stream = [t for d in expected if len(d) > 1 for t in d]
    rows = read_rows(root)
    assert [t for row in rows for t in row["tokens"]] == stream[:len(rows) * 64]
    for row in rows:
        assert sum(row["doc_lens"]) == 64 and all(n > 0 for n in row["doc_lens"])
        for n, source, offset in zip(row["doc_lens"], row["doc_source"], row["doc_offset"]):
            start = sum(row["doc_lens"][:row["doc_source"].index(source)])
            assert row["tokens"][start:start + n] == expected[source][offset:offset + n]
    assert 3 not in {s for row in rows for s in row["doc_source"]}  # the empty document was dropped
    offsets, lens = Dataset(root).read_doc_lens(0)
    assert offsets.size == 11 and int(lens.sum()) == 640


def test_truncate_is_the_papers_setting(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", ["x" * 100, "y" * 10, "z" * 70])
    result = pack(src, tmp_path / "out", "--overflow", "truncate")
    assert result.exit_code == 0, result.output
    rows = read_rows(tmp_path / "out")
    assert [(r["doc_source"], r["doc_offset"], r["doc_lens"]) for r in rows] == [([0], [0], [64]),
                                                                                ([1, 2], [0, 0], [11, 53])]
    counts = json.loads((tmp_path / "out" / "manifest.json").read_text())["counts"]
    assert counts["documents_truncated"] == 2 and counts["tokens_truncated"] == 37 + 18
    assert counts["documents_split"] == 0 and counts["tokens_dropped_tail"] == 0


def test_documents_longer_than_the_context_are_split(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", ["a" * 200, "b" * 54])
    assert pack(src, tmp_path / "out").exit_code == 0
    rows = read_rows(tmp_path / "out")
    assert [(r["doc_source"], r["doc_offset"]) for r in rows] == [([0], [0]), ([0], [64]), ([0], [128]),
                                                                  ([0, 1], [192, 0])]
    counts = json.loads((tmp_path / "out" / "manifest.json").read_text())["counts"]
    assert counts["documents_split"] == 1 and counts["tokens_dropped_tail"] == 0


def test_same_bytes_for_any_number_of_workers(tmp_path, monkeypatch):
    monkeypatch.setattr(pack_module, "BATCH_RECORDS", 7)  # many batches in flight
    src = write_jsonl(tmp_path / "in.jsonl", random_docs(300, seed=1))
    hashes = []
    for workers in (1, 2, 3):
        out = tmp_path / f"w{workers}"
        result = run(src, "-o", out, "--context-len", "256", "--workers", workers, "--rows-per-file", "20")
        assert result.exit_code == 0, result.output
        hashes.append(file_hashes(out))
    assert len(hashes[0]) >= 3 and hashes[0] == hashes[1] == hashes[2]


def test_folders_globs_include_and_text_inputs(tmp_path):
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "m.py").write_text("def f():\n    return 1\n" * 5)
    (tmp_path / "src" / "a.txt").write_text("plain text document " * 4)
    write_jsonl(tmp_path / "src" / "b.jsonl", ["json doc " * 8])
    result = pack(tmp_path / "src", tmp_path / "out", "--include", "*.py", context_len=16)
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [Path(i["path"]).name for i in manifest["inputs"]] == ["a.txt", "b.jsonl", "m.py"]
    assert [i["first_document"] for i in manifest["inputs"]] == [0, 1, 2]


def test_files_a_folder_search_leaves_out_are_reported_by_ending(tmp_path):
    """.md, .rst and other files of an input folder are not read silently: one line counts them by ending."""
    (tmp_path / "src" / "docs").mkdir(parents=True)
    (tmp_path / "src" / "a.txt").write_text("plain text document " * 4)
    for name in ("docs/guide.md", "docs/api.md", "docs/index.rst", "Makefile", ".hidden.md"):
        (tmp_path / "src" / name).write_text("# heading\n" * 3)
    result = pack(tmp_path / "src", tmp_path / "out", context_len=16)
    assert result.exit_code == 0, result.output
    assert ("not read: 4 file(s) of the input folders that are not .jsonl, .jsonl.gz, .parquet or .txt (2 .md, "
            "1 .rst, 1 no extension); --include GLOB reads such files as plain text, one document per file (e.g. "
            "--include '*.md')") in result.stderr
    result = pack(tmp_path / "src", tmp_path / "out2", "--include", "*.md", "--json", context_len=16)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["notes"] == [
        "not read: 2 file(s) of the input folders that are not .jsonl, .jsonl.gz, .parquet or .txt (1 .rst, 1 no "
        "extension); --include GLOB reads such files as plain text, one document per file (e.g. --include '*.rst')"]
    assert "not read" not in pack(tmp_path / "src" / "a.txt", tmp_path / "out3", context_len=16).stderr


# ---- bad input: one test each ----

def test_missing_input_file(tmp_path):
    result = pack(tmp_path / "nope.jsonl", tmp_path / "out")
    assert result.exit_code == 1 and "input" in result.output and "does not exist" in result.output
    assert not (tmp_path / "out").exists()


def test_unreadable_input_file(tmp_path):
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all\n")
    result = pack(tmp_path / "bad.jsonl.gz", tmp_path / "out")
    assert result.exit_code == 1 and "is not a readable gzip file" in result.output
    assert not (tmp_path / "out").exists()
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 garbage")
    result = pack(tmp_path / "bad.parquet", tmp_path / "out")
    assert result.exit_code == 1 and "is not a readable Parquet file" in result.output


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_input_without_read_permission(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", ["x"])
    src.chmod(0)
    result = pack(src, tmp_path / "out")
    assert result.exit_code == 1 and "cannot read input" in result.output
    assert "Permission denied" in result.output


def test_empty_input_file(tmp_path):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    result = pack(tmp_path / "empty.jsonl", tmp_path / "out")
    assert result.exit_code == 1 and "the inputs hold no documents" in result.output
    assert not (tmp_path / "out").exists()
    write_jsonl(tmp_path / "full.jsonl", ["x" * 200])
    result = pack([tmp_path / "empty.jsonl", tmp_path / "full.jsonl"], tmp_path / "out")
    assert result.exit_code == 0 and "are empty" in result.output
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["counts"]["inputs_empty"] == 1


@pytest.mark.parametrize("bad_line, reason, sentence", [
    (b'{"text": "unterminated', "invalid_json", "line 2 is not a JSON object"),
    (b'{"title": "no text here"}', "missing_field", "line 2 has no value under the text field 'text'"),
    (b'{"text": "caf\xe9 latin-1"}', "invalid_utf8", "line 2 holds bytes that are not valid UTF-8"),
])
def test_bad_records_are_skipped_and_counted_or_fatal_with_strict(tmp_path, bad_line, reason, sentence):
    src = write_jsonl(tmp_path / "in.jsonl", ["a" * 100, bad_line, "b" * 100])
    result = pack(src, tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "skipped 1 bad records" in result.output
    counts = json.loads((tmp_path / "out" / "manifest.json").read_text())["counts"]
    assert counts["records_skipped"][reason] == 1 and counts["records_skipped_total"] == 1
    assert counts["documents_read"] == 2
    assert [r["doc_source"] for r in read_rows(tmp_path / "out")] == [[0], [0, 1], [1]]
    result = pack(src, tmp_path / "strict", "--strict")
    assert result.exit_code == 1 and sentence in result.output
    assert not (tmp_path / "strict").exists()


def test_non_utf8_text_file(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00broken")
    (tmp_path / "good.txt").write_text("g" * 100)
    result = pack([tmp_path / "bad.txt", tmp_path / "good.txt"], tmp_path / "out")
    assert result.exit_code == 0 and "1 invalid utf8" in result.output
    result = pack([tmp_path / "bad.txt", tmp_path / "good.txt"], tmp_path / "strict", "--strict")
    assert result.exit_code == 1 and "(plain text) holds bytes that are not valid UTF-8" in result.output


def test_empty_documents_are_dropped_and_counted(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", ["", "a" * 70, "", ""])
    assert pack(src, tmp_path / "out").exit_code == 0
    counts = json.loads((tmp_path / "out" / "manifest.json").read_text())["counts"]
    assert counts["documents_dropped_empty"] == 3 and counts["documents_read"] == 4
    assert read_rows(tmp_path / "out")[0]["doc_source"] == [1]


@pytest.mark.parametrize("context_len", ["1", "0", "-5"])
def test_context_length_below_two(tmp_path, context_len):
    src = write_jsonl(tmp_path / "in.jsonl", ["abc"])
    result = pack(src, tmp_path / "out", context_len=context_len)
    assert result.exit_code == 1 and "context length must be at least 2 tokens" in result.output


def test_unknown_tokenizer(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", ["abc"])
    result = run(src, "-o", tmp_path / "out", "--context-len", "8", "--tokenizer", "llama-9")
    assert result.exit_code == 1
    assert "unknown tokenizer 'llama-9'" in result.output and "deepseek-v3, byte" in result.output


def test_too_little_text_for_one_sequence(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", ["short"])
    result = pack(src, tmp_path / "out")
    assert result.exit_code == 1 and "fewer than one sequence of 64" in result.output
    assert not (tmp_path / "out").exists()


def _read_only_folder(path: Path) -> bool:
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        return True
    return subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0


def test_read_only_output_folder(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", ["a" * 100])
    out = tmp_path / "ro"
    if not _read_only_folder(out):
        pytest.skip("cannot make a read-only folder here (root without chattr); see the simulated test")
    try:
        result = pack(src, out)
        assert result.exit_code == 1 and f"cannot write to output folder {out}" in result.output
        result = pack(src, out / "sub")
        assert result.exit_code == 1 and "cannot write to output folder" in result.output
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(out)])
        out.chmod(0o755)
    assert list(out.iterdir()) == []


def test_read_only_output_folder_simulated(tmp_path, monkeypatch):
    """The same check where no folder can be made read-only: the probe write fails as on a read-only mount."""
    import flashcp.data.pack_output as pack_output

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(pack_output.tempfile, "mkstemp", read_only)
    src = write_jsonl(tmp_path / "in.jsonl", ["a" * 100])
    (tmp_path / "ro").mkdir()
    result = pack(src, tmp_path / "ro")
    assert result.exit_code == 1
    assert f"cannot write to output folder {tmp_path / 'ro'}: Read-only file system" in result.output


def test_write_failure_mid_run_leaves_no_partial_dataset(tmp_path, monkeypatch):
    from flashcp.data.dataset import DataFileWriter

    original, calls = DataFileWriter.write, []

    def failing_write(self, table):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        original(self, table)

    monkeypatch.setattr(DataFileWriter, "write", failing_write)
    src = write_jsonl(tmp_path / "in.jsonl", random_docs(100))
    result = pack(src, tmp_path / "out", "--rows-per-file", "2", "--row-group-rows", "1")
    assert result.exit_code == 1 and "No space left on device" in result.output
    assert not (tmp_path / "out").exists()


# ---- existing output: refuse, force, nothing to do, resume after SIGKILL ----

def test_existing_output_is_refused_unless_same_or_forced(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", random_docs(50))
    out = tmp_path / "out"
    assert pack(src, out).exit_code == 0
    before = file_hashes(out)
    result = pack(src, out)
    assert result.exit_code == 0 and "already holds this dataset" in result.output
    result = pack(src, out, context_len=32)
    assert result.exit_code == 1
    assert "already holds a dataset packed with other inputs or options (context length 64 there, 32 now)" \
        in result.output
    assert file_hashes(out) == before
    (out / "plans" / "cp2").mkdir(parents=True)
    result = pack(src, out, "--force", context_len=32)
    assert result.exit_code == 0 and not (out / "plans").exists()
    assert json.loads((out / "manifest.json").read_text())["context_len"] == 32
    other = tmp_path / "other"
    other.mkdir()
    (other / "mine.txt").write_text("keep me")
    result = pack(src, other)
    assert result.exit_code == 1 and "is not empty and holds no flashcp dataset" in result.output
    assert pack(src, other, "--force").exit_code == 0 and (other / "mine.txt").read_text() == "keep me"


def test_output_inside_an_input_folder_is_not_read(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", random_docs(40))
    assert pack(tmp_path, tmp_path / "out").exit_code == 0
    result = pack(tmp_path, tmp_path / "out")  # the dataset's own Parquet files are not inputs
    assert result.exit_code == 0 and "already holds this dataset" in result.output


def test_a_folder_being_written_is_refused(tmp_path):
    import fcntl

    src = write_jsonl(tmp_path / "in.jsonl", random_docs(40))
    (tmp_path / "out").mkdir()
    fd = os.open(tmp_path / "out", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        result = pack(src, tmp_path / "out")
        assert result.exit_code == 1 and "another flashcp pack is writing to" in result.output
    finally:
        os.close(fd)
    assert pack(src, tmp_path / "out").exit_code == 0


def test_finished_dataset_with_a_damaged_file_is_refused(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", random_docs(50))
    out = tmp_path / "out"
    assert pack(src, out).exit_code == 0
    with open(out / "data" / "part-00000.parquet", "ab") as f:
        f.write(b"junk")
    result = pack(src, out)
    assert result.exit_code == 1 and "data/part-00000.parquet does not match the manifest" in result.output
    assert pack(src, out, "--force").exit_code == 0


def test_tokenizer_without_eos_needs_no_eos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    src = write_jsonl(tmp_path / "in.jsonl", ["a b a b"] * 10)
    args = [src, "-o", tmp_path / "out", "--context-len", "8", "--tokenizer", tmp_path / "tokenizer.json",
            "--workers", "1"]
    result = run(*args)
    assert result.exit_code == 1 and "names no end-of-sequence token" in result.output
    result = run(*args, "--no-eos")
    assert result.exit_code == 0, result.output
    assert read_rows(tmp_path / "out")[0]["tokens"] == [1, 2, 1, 2, 1, 2, 1, 2]


@pytest.mark.parametrize("overflow, workers, kill_at", [("split", 1, 4), ("split", 2, 7), ("truncate", 1, 5)])
def test_resume_after_sigkill_ends_with_the_same_bytes(tmp_path, overflow, workers, kill_at):
    docs = random_docs(150, seed=2)
    docs[20] = ""
    sources = [write_jsonl(tmp_path / "in-0.jsonl", docs[:60]),
               write_jsonl(tmp_path / "in-1.jsonl", docs[60:100] + [b"{broken"] + docs[100:140]),
               write_jsonl(tmp_path / "in-2.jsonl", docs[140:])]
    args = [*map(str, sources), "--context-len", "100", "--tokenizer", "byte", "--overflow", overflow,
            "--rows-per-file", "3", "--row-group-rows", "2", "--workers", str(workers)]
    reference = tmp_path / "reference"
    assert run(*args, "-o", reference).exit_code == 0

    out = tmp_path / "out"
    env = {**os.environ, "KILL_AT_GROUP": str(kill_at), "PYTHONPATH": str(ROOT)}
    killed = subprocess.run([sys.executable, "-c", KILLER, "pack", *args, "-o", str(out)], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    state = json.loads((out / "pack-state.json").read_text())
    assert not (out / "manifest.json").exists() and len(state["parts"]) == (kill_at - 1) // 2
    assert any(p.name.endswith(".tmp") for p in (out / "data").iterdir())  # killed mid-file
    if overflow == "split":
        assert any(part["resume"]["offset"] > 0 for part in state["parts"])  # some part ends mid-document

    result = run(*args, "-o", out, "--context-len", "99")
    assert result.exit_code == 1 and "holds an unfinished pack with other inputs or options" in result.output
    result = CliRunner().invoke(cli, ["-v", "pack", *args, "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "resumed an interrupted pack after" in result.output
    assert file_hashes(out) == file_hashes(reference)
    manifest = json.loads((out / "manifest.json").read_text())
    assert [i["documents"] for i in manifest["inputs"]] == [60, 80, 10]
