"""The fault suite: bad names, symlinks, full disks, read-only folders, damaged and replaced files.

Every case asserts the exit code, exactly one line on stderr, no traceback, and that every file and folder
that existed before (the whole temporary tree, dataset and bystanders alike) is byte-identical afterwards.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from flashcp.data.dataset import Dataset
from flashcp.errors import FlashcpError
from tests.faults.workspace import (
    ReadOnly,
    docs,
    one_sentence,
    pack_args,
    packed_template,
    run,
    tree,
    unchanged,
    workspace,
    write_jsonl,
)


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A packed dataset (byte tokenizer, 64-token sequences, 3 data files) with one plan, and its input."""
    base = packed_template(tmp_path_factory.mktemp("faults"), 40, [(2, "flashcp")])
    assert len(Dataset(base / "data").files) >= 2
    return base


@pytest.fixture
def ws(template, tmp_path):
    """A private copy of the template, plus a bystander folder outside the dataset."""
    return workspace(template, tmp_path, {"victim/precious.txt": "do not touch"})


# ---- 1. names written inside a dataset are plain names, checked before anything is touched ----

HOSTILE = ["", ".", "..", "../../victim", "../victim", "/tmp/abs", "a/b", ".hidden", "new\nline", "tab\there",
           "x" * 300]


@pytest.mark.parametrize("name", HOSTILE)
def test_plan_name_must_be_plain(ws, name):
    unchanged(ws, ["plan", ws / "data", "--cp", 2, "--strategy", "flashcp", "--name", name, "--force"],
              "is not a plain folder name")


@pytest.mark.parametrize("name", ["", ".", "..", "../../victim", "cp2-flashcp/.."])
def test_audit_write_plan_must_be_plain(ws, name):
    unchanged(ws, ["audit", ws / "data", "--plan", "cp2-flashcp", "--ilp", "--samples", 1, "--time-limit", 1,
                   "--granularity", 8, "--write-plan", name, "--force"], "--write-plan", "plain folder name")


def test_audit_write_plan_never_replaces_what_flashcp_did_not_write(ws):
    user = ws / "data" / "plans" / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    unchanged(ws, ["audit", ws / "data", "--plan", "cp2-flashcp", "--samples", 1, "--time-limit", 1,
                   "--granularity", 8, "--write-plan", "mine", "--force"], "'notes.txt', which flashcp did not write")


def test_markup_in_names_and_paths_is_printed_as_is(ws):
    err = unchanged(ws, ["pack", ws / "x[/red].jsonl", "-o", ws / "o", "--context-len", 64, "--tokenizer", "byte"],
                    "x[/red].jsonl")
    assert "MarkupError" not in err
    (ws / "w[").mkdir()
    (ws / "w[" / "b].jsonl").write_text("")  # an empty input: its path "w[/b].jsonl" is in a warning
    write_jsonl(ws / "w[" / "more.jsonl", docs(20))
    result = run(*pack_args([ws / "w[" / "b].jsonl", ws / "w[" / "more.jsonl"], ws / "out[/b]"))
    assert result.exit_code == 0, result.output
    assert "w[/b].jsonl" in result.stderr and (ws / "out[/b]" / "manifest.json").is_file()
    result = run("plan", ws / "out[/b]", "--cp", 2, "--strategy", "flashcp", "--name", "odd[bold]name")
    assert result.exit_code == 0 and (ws / "out[/b]" / "plans" / "odd[bold]name" / "plan.json").is_file()


def test_newline_in_a_path_stays_on_one_line(ws):
    unchanged(ws, ["show", ws / "no\nsuch"], "does not exist")


# ---- 2. pack --force builds beside and swaps: a failure leaves the old dataset byte-identical ----

def test_failed_force_pack_keeps_the_old_dataset(ws):
    no_field = write_jsonl(ws / "other.jsonl", docs(30), key="body")
    unchanged(ws, pack_args(no_field, ws / "data", "--force"), "no documents")
    unchanged(ws, pack_args(ws / "in.jsonl", ws / "data", "--force", context_len=100_000),
              "fewer than one sequence")


def test_disk_full_during_force_pack_keeps_the_old_dataset(ws, monkeypatch):
    from flashcp.data.dataset import DataFileWriter

    original, calls = DataFileWriter.write, []

    def write(self, table):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        original(self, table)

    monkeypatch.setattr(DataFileWriter, "write", write)
    unchanged(ws, pack_args(ws / "in.jsonl", ws / "data", "--force", context_len=32), "No space left on device")


def test_failure_during_the_swap_is_rolled_back(ws, monkeypatch):
    import flashcp.data.pack_output as pack_output

    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if Path(src).name == "manifest.json" and Path(src).parent.name == ".flashcp-replacement":
            raise OSError(errno.EIO, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(pack_output.os, "replace", replace)
    unchanged(ws, pack_args(ws / "in.jsonl", ws / "data", "--force", context_len=32), "Input/output error")
    assert any(Path(d).name == "data" for d in calls)  # the swap was under way when it failed


def test_force_pack_replaces_the_dataset_and_its_plans(ws):
    result = run(*pack_args(ws / "in.jsonl", ws / "data", "--force", context_len=32))
    assert result.exit_code == 0, result.output
    assert Dataset(ws / "data").context_len == 32
    assert sorted(p.name for p in (ws / "data").iterdir()) == ["data", "manifest.json"]


def test_force_pack_refuses_a_folder_that_is_not_a_flashcp_dataset(ws):
    other = ws / "other"
    (other / "plans" / "mine").mkdir(parents=True)
    (other / "manifest.json").write_text('{"my": "own manifest"}')
    (other / "plans" / "mine" / "x.txt").write_text("mine")
    unchanged(ws, pack_args(ws / "in.jsonl", other, "--force"), "is not a flashcp dataset manifest")
    (other / "manifest.json").unlink()
    unchanged(ws, pack_args(ws / "in.jsonl", other, "--force"), "holds no flashcp dataset")


@pytest.mark.parametrize("intruder", ["data/notes.txt", "plans/cp2-flashcp/notes.txt", "plans/notes.txt"])
def test_force_pack_refuses_a_dataset_holding_files_flashcp_did_not_make(ws, intruder):
    (ws / "data" / intruder).write_text("mine")
    unchanged(ws, pack_args(ws / "in.jsonl", ws / "data", "--force", context_len=32), "was not made by flashcp")


# ---- 3. symlinks: nothing is written, renamed or deleted through one ----

@pytest.mark.parametrize("link", ["data", "plans", "plans/cp2-flashcp", "data/part-00000.parquet",
                                  "manifest.json", ".flashcp-replacement"])
def test_force_pack_never_follows_a_symlink(ws, link):
    path = ws / "data" / link
    outside = ws / "victim" / "moved"
    if path.exists():
        os.rename(path, outside)
    else:  # where the replacement would be built
        outside.mkdir()
    path.symlink_to(outside)
    unchanged(ws, pack_args(ws / "in.jsonl", ws / "data", "--force", context_len=32), "symlink")


@pytest.mark.parametrize("link", ["plans", "plans/cp2-flashcp"])
def test_plan_never_writes_through_a_symlink(ws, link):
    path = ws / "data" / link
    outside = ws / "victim" / "plans-elsewhere"
    os.rename(path, outside)
    path.symlink_to(outside)
    unchanged(ws, ["plan", ws / "data", "--cp", 2, "--strategy", "flashcp", "--force"], "is a symlink")
    unchanged(ws, ["plan", ws / "data", "--cp", 2, "--strategy", "llama3"] if link == "plans" else
              ["plan", ws / "data", "--cp", 2, "--strategy", "flashcp"], "is a symlink")


def test_resumed_pack_never_deletes_through_a_data_symlink(ws, tmp_path):
    out = ws / "half"
    (out / "data").mkdir(parents=True)
    state = {"format": "flashcp-pack-state", "identity_sha256": "x", "identity": {}, "parts": []}
    (out / "pack-state.json").write_text(json.dumps(state))
    os.rename(out / "data", ws / "victim" / "data")
    (out / "data").symlink_to(ws / "victim" / "data")
    unchanged(ws, pack_args(ws / "in.jsonl", out), "is a symlink")


# ---- 4. a replaced, truncated or corrupted data file is noticed by every reader at open ----

def _replace_data_file(ws: Path) -> Path:
    """Rewrite data file 0 with other tokens, same rows and lengths; the manifest is left as it was."""
    path = ws / "data" / "data" / "part-00000.parquet"
    table = pq.read_table(path)
    tokens = [[(t + 1) % 256 for t in row] for row in table.column("tokens").to_pylist()]
    import pyarrow as pa

    table = table.set_column(0, "tokens", pa.array(tokens, pa.list_(pa.int32())))
    pq.write_table(table, path, compression="zstd", use_dictionary=False, write_statistics=False)
    return path


READERS = [["show", "{d}", "--plan", "cp2-flashcp"], ["plan", "{d}", "--cp", 2, "--strategy", "flashcp", "--force"],
           ["audit", "{d}", "--plan", "cp2-flashcp", "--samples", 1, "--time-limit", 1, "--granularity", 8],
           ["bench", "{d}", "--quick", "--scenario", "quality"], ["verify", "{d}"], ["verify", "{d}", "--fast"]]


def _readers(ws):
    return [[str(ws / "data") if a == "{d}" else a for a in command] for command in READERS]


@pytest.mark.parametrize("damage", ["replaced", "truncated", "footer", "body"])
def test_every_reader_refuses_a_damaged_data_file(ws, damage):
    path = ws / "data" / "data" / "part-00000.parquet"
    data = bytearray(path.read_bytes())
    if damage == "replaced":
        _replace_data_file(ws)
        assert path.read_bytes() != bytes(data)
    elif damage == "truncated":
        path.write_bytes(data[:-100])
    elif damage == "footer":
        data[-20] ^= 0xFF
        path.write_bytes(data)
    else:  # every page of the body, same size, footer intact
        data[8:len(data) - 8 - int.from_bytes(data[-8:-4], "little")] = b"\0" * (
            len(data) - 16 - int.from_bytes(data[-8:-4], "little"))
        path.write_bytes(data)
    for command in _readers(ws):
        if damage == "body" and (command[0] not in ("plan", "verify") or command[-1] == "--fast"):
            continue  # the footer is intact: only readers of these pages (and verify's hash) can tell
        unchanged(ws, command, "part-00000.parquet")
    if damage != "body":
        from flashcp.runtime import CPLoader

        with pytest.raises(FlashcpError, match="part-00000.parquet"):
            CPLoader(ws / "data", plan="cp2-flashcp", rank=0, world_size=2)


def test_ls_lists_plans_and_flags_a_replaced_file(ws):
    result = run("ls", ws / "data")
    assert result.exit_code == 0 and "cp2-flashcp" in result.stdout and "fresh" in result.stdout
    _replace_data_file(ws)
    result = run("ls", ws / "data")
    assert result.exit_code == 0 and "part-00000.parquet" in result.stderr and result.stderr.count("\n") == 1


def test_older_manifest_without_fingerprints_still_opens(ws):
    path = ws / "data" / "manifest.json"
    manifest = json.loads(path.read_text())
    for entry in manifest["files"]:
        del entry["bytes"], entry["footer_sha256"]
    path.write_text(json.dumps(manifest))
    assert Dataset(ws / "data").num_sequences == manifest["num_sequences"]
    assert run("show", ws / "data").exit_code == 0


# ---- 5/6. malformed JSON, disk full and read-only folders: one sentence, nothing changed ----

MANIFESTS = {
    "not JSON": "{not json",
    "a list": "[]",
    "empty object": {},
    "no context_len": {"drop": "context_len"},
    "files not a list": {"set": ("files", 3)},
    "file entry not an object": {"set": ("files", [1])},
    "file path outside": {"path": "../../victim/precious.txt"},
    "context_len a string": {"set": ("context_len", "64")},
}


@pytest.mark.parametrize("case", MANIFESTS)
def test_malformed_manifest(ws, case):
    path = ws / "data" / "manifest.json"
    change = MANIFESTS[case]
    if isinstance(change, str) or not change:
        path.write_text(json.dumps(change) if not change else change)
    else:
        manifest = json.loads(path.read_text())
        if "drop" in change:
            del manifest[change["drop"]]
        elif "set" in change:
            manifest[change["set"][0]] = change["set"][1]
        else:
            manifest["files"][0]["path"] = change["path"]
        path.write_text(json.dumps(manifest))
    for command in (["show", ws / "data"], ["plan", ws / "data", "--cp", 2, "--strategy", "flashcp", "--force"],
                    ["verify", ws / "data"], ["ls", ws / "data"]):
        unchanged(ws, command, "manifest.json")
    unchanged(ws, pack_args(ws / "in.jsonl", ws / "data"))  # without --force: refused, one sentence
    if isinstance(change, str) or not change:  # not recognisably flashcp's: never overwritten
        unchanged(ws, pack_args(ws / "in.jsonl", ws / "data", "--force", context_len=32), "manifest")
    else:  # a damaged flashcp manifest: --force replaces the dataset
        assert run(*pack_args(ws / "in.jsonl", ws / "data", "--force", context_len=32)).exit_code == 0


@pytest.mark.parametrize("content", ["[]", "{broken", '{"format": "flashcp-plan"}', "cp-missing"])
def test_malformed_plan_json(ws, content):
    path = ws / "data" / "plans" / "cp2-flashcp" / "plan.json"
    if content == "cp-missing":
        meta = json.loads(path.read_text())
        del meta["cp"]
        content = json.dumps(meta)
    path.write_text(content)
    for command in (["show", ws / "data", "--plan", "cp2-flashcp"], ["verify", ws / "data"]):
        unchanged(ws, command, "plan.json")


def test_plan_on_a_full_disk(ws, monkeypatch):
    import flashcp.planner.plan_writer as plan_writer

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(plan_writer.PlanFileWriter, "write", full)  # the disk fills while a plan file is written
    unchanged(ws, ["plan", ws / "data", "--cp", 2, "--strategy", "flashcp", "--force"], "No space left on device")
    unchanged(ws, ["plan", ws / "data", "--cp", 4, "--strategy", "flashcp"], "No space left on device")
    monkeypatch.undo()
    monkeypatch.setattr(plan_writer, "write_json_atomic", full)
    unchanged(ws, ["plan", ws / "data", "--cp", 2, "--strategy", "flashcp", "--force"], "No space left on device")


@pytest.mark.parametrize("command", [
    ["plan", "{d}", "--cp", 2, "--strategy", "flashcp", "--force"],
    ["plan", "{d}", "--cp", 4, "--strategy", "flashcp"],
    ["audit", "{d}", "--plan", "cp2-flashcp", "--samples", 1, "--time-limit", 1, "--granularity", 8,
     "--write-plan", "ilp", "--force"],
    pack_args("{in}", "{d}", "--force", context_len=32),
])
def test_read_only_dataset(ws, monkeypatch, command):
    command = [str(ws / "data") if a == "{d}" else str(ws / "in.jsonl") if a == "{in}" else a for a in command]
    before = tree(ws)
    with monkeypatch.context() as m:
        ReadOnly(m, ws / "data")
        result = run(*command)
    one_sentence(result, "Permission denied")
    assert tree(ws) == before


# ---- 7. leftovers, concurrency, bad numbers, wrong kinds of paths ----

def test_staging_left_by_a_killed_plan_is_removed_and_reported(ws):
    leftover = ws / "data" / "plans" / ".cp2-flashcp.4242-0123abcd.tmp"
    leftover.mkdir()
    (leftover / "part-00000.parquet").write_bytes(b"half")
    result = run("verify", ws / "data")
    assert result.exit_code == 0 and "staging folder left by an interrupted plan" in result.stderr
    result = run("plan", ws / "data", "--cp", 2, "--strategy", "flashcp", "--force")
    assert result.exit_code == 0 and "removed 1 staging folder(s)" in result.stderr
    assert not leftover.exists()


def test_a_plan_being_written_is_not_written_twice(ws):
    from flashcp.fileio import FolderLock

    lock = FolderLock(ws / "data" / "plans" / ".cp2-flashcp.lock", "busy")
    try:
        unchanged(ws, ["plan", ws / "data", "--cp", 2, "--strategy", "flashcp", "--force"],
                  "another flashcp command is writing plan")
    finally:
        lock.release()
    assert run("plan", ws / "data", "--cp", 2, "--strategy", "flashcp", "--force").exit_code == 0


@pytest.mark.parametrize("value", ["inf", "nan", "0.5", "-inf"])
def test_target_imbalance_must_be_finite(ws, value):
    unchanged(ws, ["plan", ws / "data", "--cp", 2, "--strategy", "flashcp", "--target-imbalance", value, "--name", "x"],
              "--target-imbalance must be a finite number of at least 1")


def test_wrong_kinds_of_paths_and_numbers(ws):
    unchanged(ws, ["show", ws / "in.jsonl"], "is a file, not a dataset folder")
    unchanged(ws, ["synth", ws / "s", "--dist", "wlb", "--num-seqs", 2, "--context-len", 1],
              "context length must be at least 2")
    unchanged(ws, ["bench", ws / "missing"], "dataset folder", "does not exist")
    unchanged(ws, ["audit", ws / "data", "--plan", "cp2-flashcp", "--granularity", 65],
              "larger than the context length 64")


@pytest.mark.parametrize("options, needle", [
    (["--runtime-cp", 1], "needs at least 2"),
    (["--runtime-cp", 5000], "some rank would get none"),
    (["--runtime-cp", 40, "--runtime-context-len", 32], "cp 40 is above the 32 tokens per sequence"),
])
def test_bench_refuses_a_runtime_cp_it_cannot_run(ws, options, needle):
    """Refused with one sentence before any scenario runs (cp 1 was a ValueError traceback after the others)."""
    report = ws / "report.json"
    unchanged(ws, ["bench", ws / "data", "--quick", "--seqs", 1, "--cp", 2, "--json", report, *options],
              "--runtime-cp", needle)
    assert not report.exists()


# ---- the scriptable CLI: --json on stdout, text on stderr; -q / -v after the command ----

def test_json_results_and_verbosity_after_the_command(ws):
    result = run("ls", ws / "data", "--json")
    listing = json.loads(result.stdout)
    assert [p["name"] for p in listing["plans"]] == ["cp2-flashcp"] and listing["plans"][0]["status"] == "fresh"
    result = run("plan", ws / "data", "--cp", 2, "--strategy", "perdoc", "--json", "-q")
    meta = json.loads(result.stdout)["plan"]
    assert meta["name"] == "cp2-perdoc" and "cp2 over 83 sequences" in result.stderr
    result = run("verify", ws / "data", "--json")
    report = json.loads(result.stdout)
    assert report["ok"] and report["plans"] == {"cp2-flashcp": report["sequences"],
                                                  "cp2-perdoc": report["sequences"]}, report
    result = run("show", ws / "data", "--plan", "cp2-perdoc", "--seq", 1, "--json")
    shown = json.loads(result.stdout)
    assert shown["sequence"] == 1 and sum(shown["shards"]["len"]) == 64 and len(shown["ranks"]) == 2
    result = run(*pack_args(ws / "in.jsonl", ws / "new", "--json"))
    packed = json.loads(result.stdout)
    assert packed["already_done"] is False and packed["manifest"]["num_sequences"] == 83
    assert "packed 83 sequences" in result.stderr
    result = run("plan", ws / "data", "--cp", 2, "--strategy", "perdoc", "--name", "quiet", "-q")
    assert result.exit_code == 0 and "wrote" not in result.stderr
    result = run("plan", ws / "data", "--cp", 2, "--strategy", "llama3", "-v")
    assert result.exit_code == 0 and "wrote" in result.stderr
    result = run(*pack_args(ws / "in.jsonl", ws / "new", "-q"))
    assert result.exit_code == 0 and "already holds this dataset" in result.stdout


def test_verify_reports_every_problem(ws):
    _replace_data_file(ws)
    path = ws / "data" / "plans" / "cp2-flashcp" / "part-00001.parquet"
    path.write_bytes(path.read_bytes() + b"x")
    result = run("verify", ws / "data", "--json")
    assert result.exit_code == 1
    problems = json.loads(result.stdout)["problems"]
    assert len(problems) == 2 and "part-00000.parquet" in problems[0] and "cp2-flashcp" in problems[1]
    assert result.stderr.count("error:") == 2 and "Traceback" not in result.output


def test_an_old_plan_moved_aside_by_a_crash_is_put_back(ws, monkeypatch):
    """Where paths cannot be exchanged atomically, a crash between the two renames is repaired."""
    plans = ws / "data" / "plans"
    before = tree(ws)
    os.rename(plans / "cp2-flashcp", plans / ".cp2-flashcp.old-99-0123abcd.tmp")
    result = run("plan", ws / "data", "--cp", 2, "--strategy", "flashcp")  # put back, and it is up to date
    assert result.exit_code == 0 and "restored plan 'cp2-flashcp'" in result.stderr and "up to date" in result.stderr
    assert tree(ws) == before
    import flashcp.fileio as fileio

    monkeypatch.setattr(fileio, "_renameat2", None)
    result = run("plan", ws / "data", "--cp", 2, "--strategy", "flashcp", "--force", "--target-imbalance", 1.3)
    assert result.exit_code == 0 and sorted(p.name for p in plans.iterdir()) == ["cp2-flashcp"]
    assert json.loads((plans / "cp2-flashcp" / "plan.json").read_text())["params"]["target_imbalance"] == 1.3


@pytest.mark.parametrize("damage", ["replaced", "truncated", "not parquet"])
def test_a_damaged_plan_file_is_refused_at_open(ws, damage):
    path = ws / "data" / "plans" / "cp2-flashcp" / "part-00000.parquet"
    if damage == "replaced":  # the same rows, written again: another file
        pq.write_table(pq.read_table(path), path, compression="snappy")
    else:
        path.write_bytes(path.read_bytes()[:-30] if damage == "truncated" else b"nothing like parquet")
    unchanged(ws, ["show", ws / "data", "--plan", "cp2-flashcp"], "part-00000.parquet")
    unchanged(ws, ["verify", ws / "data", "--fast"], "part-00000.parquet")
    from flashcp.runtime import CPLoader

    with pytest.raises(FlashcpError, match="part-00000.parquet"):
        CPLoader(ws / "data", plan="cp2-flashcp", rank=0, world_size=2)


def test_bench_lists_each_strategy_once():
    from flashcp.bench.systems import available_strategies

    names = available_strategies()
    assert "ring" in names and len(names) == len(set(names))


def test_synth_removes_the_staging_folder_of_a_killed_run(ws):
    import subprocess

    from flashcp.outputs import make_marked_dir

    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = make_marked_dir(ws / f".s.{dead.pid}-0123abcd.tmp", "synth staging")  # as synth makes it
    (leftover / "data").mkdir()
    (leftover / "data" / "part-00000.parquet").write_bytes(b"half")
    unmarked = ws / f".s.{dead.pid}-4567abcd.tmp"  # the same kind of name, but not flashcp's: left alone
    (unmarked / "data").mkdir(parents=True)
    (unmarked / "data" / "mine.txt").write_text("mine")
    alive = ws / f".s.{os.getpid()}-0123abcd.tmp"  # a run still going: left alone
    alive.mkdir()
    result = run("synth", ws / "s", "--dist", "wlb", "--num-seqs", 2, "--context-len", 64, "--no-tokens")
    assert result.exit_code == 0 and not leftover.exists() and alive.exists()
    assert (unmarked / "data" / "mine.txt").read_text() == "mine"
    assert sorted(p.name for p in (ws / "s").iterdir()) == ["data", "manifest.json"]  # no marker left inside
