"""The fault suite, inputs and bad values: inputs that change under a pack, inputs inside the output, hostile
records and files, numbers out of range, metadata that disagrees with the files, and ``--json`` on failure.

Every refusal asserts the exit code, exactly one line on stderr, no traceback, and that the whole temporary
tree is byte-identical afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import flashcp.data.pack as pack_module
from flashcp.costmodel.limits import MAX_CONTEXT_LEN
from flashcp.data.dataset import DataFileWriter, Dataset
from flashcp.data.pack_output import OutputFolder
from flashcp.errors import FlashcpError, PlanError
from tests.faults.workspace import ROOT, docs, one_sentence, pack_args, run, tree, unchanged, workspace, write_jsonl


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A packed dataset (byte tokenizer, 64-token sequences, several data files) with a cp2 plan."""
    base = tmp_path_factory.mktemp("inputs")
    src = write_jsonl(base / "in.jsonl", docs(40))
    assert run(*pack_args(src, base / "data")).exit_code == 0
    assert run("plan", base / "data", "--cp", 2, "--strategy", "llama3").exit_code == 0
    return base


@pytest.fixture
def ws(template, tmp_path):
    return workspace(template, tmp_path, {"victim/precious.txt": "do not touch"})


# ---- 2. an input that changes while pack reads it ----

def change_after_hashing(monkeypatch, path: Path, how: str) -> None:
    """Change ``path`` once pack has hashed its inputs, before it reads them (as another process might)."""
    real = pack_module.prepare_output

    def prepare(*args, **kwargs):
        text = path.read_text().replace("alpha", "OMEGA")
        if how == "replace":
            (path.parent / "new.tmp").write_text(text)
            os.replace(path.parent / "new.tmp", path)
        else:  # in place, the same size
            with open(path, "r+") as f:
                f.write(text)
        return real(*args, **kwargs)

    monkeypatch.setattr(pack_module, "prepare_output", prepare)


@pytest.mark.parametrize("how", ["replace", "in place"])
def test_input_changed_under_pack_is_refused(ws, monkeypatch, how):
    original = (ws / "in.jsonl").read_text()
    with monkeypatch.context() as m:
        change_after_hashing(m, ws / "in.jsonl", how)
        before = {k: v for k, v in tree(ws).items() if k != "in.jsonl"}
        err = one_sentence(run(*pack_args(ws / "in.jsonl", ws / "out")), "in.jsonl changed while flashcp pack "
                           "was reading it")
        assert {k: v for k, v in tree(ws).items() if k not in ("in.jsonl", "new.tmp")} == before, err
    (ws / "in.jsonl").write_text(original)  # the original back: packed for real, not "nothing to do"
    result = run(*pack_args(ws / "in.jsonl", ws / "out"))
    assert result.exit_code == 0 and "packed" in result.stdout, result.output
    assert data_files(ws / "out") == data_files(ws / "data")


def data_files(root: Path) -> dict[str, str]:
    return {k: v for k, v in tree(root).items() if k.startswith("data")}


def test_resumed_pack_checks_its_inputs_too(ws, monkeypatch):
    calls = []
    original_write = DataFileWriter.write

    def interrupted(self, table):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        original_write(self, table)

    with monkeypatch.context() as m:
        m.setattr(DataFileWriter, "write", interrupted)
        assert run(*pack_args(ws / "in.jsonl", ws / "out")).exit_code == 130
    state = json.loads((ws / "out" / "pack-state.json").read_text())
    assert len(state["parts"]) == 2
    original = (ws / "in.jsonl").read_text()
    with monkeypatch.context() as m:
        change_after_hashing(m, ws / "in.jsonl", "in place")
        one_sentence(run(*pack_args(ws / "in.jsonl", ws / "out")), "changed while flashcp pack was reading it")
    # the interrupted run's finished files (read before the change) stay; nothing of this run's is kept
    assert json.loads((ws / "out" / "pack-state.json").read_text()) == state
    (ws / "in.jsonl").write_text(original)
    with monkeypatch.context() as m:  # a change the stamps miss (within the clock's tick): the digest tells
        import flashcp.data.readers as readers

        for module in (readers, pack_module):
            m.setattr(module, "check_stamp", lambda input_file, st: None)
        m.setattr(pack_module, "BATCH_RECORDS", 4)  # packing keeps up with reading: parts are recorded
        change_after_hashing(m, ws / "in.jsonl", "in place")
        recorded, write_state = [], OutputFolder.write_state
        m.setattr(OutputFolder, "write_state", lambda self, *a: (recorded.append(len(self.parts)),
                                                                  write_state(self, *a)))
        one_sentence(run(*pack_args(ws / "in.jsonl", ws / "out")), "what was read does not match the sha256")
        assert max(recorded) > 2  # this run had recorded parts of its own before the end told
    assert json.loads((ws / "out" / "pack-state.json").read_text()) == state  # this run's parts forgotten
    assert sorted(p.name for p in (ws / "out" / "data").iterdir()) == ["part-00000.parquet", "part-00001.parquet"]
    (ws / "in.jsonl").write_text(original)
    result = run(*pack_args(ws / "in.jsonl", ws / "out"))
    assert result.exit_code == 0 and "resumed an interrupted pack after 2" in result.stderr, result.output
    assert data_files(ws / "out") == data_files(ws / "data")  # the same bytes as an uninterrupted pack


def test_what_is_read_is_what_was_hashed(tmp_path):
    """Even where the stamp cannot tell (the same size and times), the digest of what was read must match."""
    from dataclasses import replace

    from flashcp.data.readers import InputChanged, discover_inputs, hash_input, iter_records, recheck_input

    write_jsonl(tmp_path / "a.jsonl", docs(5))
    (tmp_path / "b.txt").write_text("plain text")
    (inputs, _) = discover_inputs([str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt")])
    hashed = [hash_input(i) for i in inputs]
    assert sum(1 for _ in iter_records(hashed)) == 6
    for i in range(2):
        wrong = list(hashed)
        wrong[i] = replace(hashed[i], sha256="0" * 64)
        with pytest.raises(InputChanged, match="what was read does not match the sha256"):
            list(iter_records(wrong))
        with pytest.raises(InputChanged, match="no longer matches the sha256"):  # --engine ray's check at the end
            recheck_input(wrong[i])
        recheck_input(hashed[i])


# ---- 4. the input inside the output ----

@pytest.mark.parametrize("case", ["folder is the output", "dataset over itself", "file inside the output"])
def test_input_inside_the_output(ws, case):
    if case == "folder is the output":
        (ws / "in2").mkdir()
        write_jsonl(ws / "in2" / "a.jsonl", docs(10))
        command = pack_args(ws / "in2", ws / "in2", "--force")
    elif case == "dataset over itself":
        command = pack_args(ws / "data", ws / "data", "--force", "--include", "*.parquet")
    else:
        write_jsonl(ws / "data" / "data" / "x.jsonl", docs(3))
        command = pack_args(ws / "data" / "data" / "x.jsonl", ws / "data", "--force")
    unchanged(ws, command, "lies inside the output folder")
    unchanged(ws, command, "lies inside the output folder")  # the same again: nothing was left to trip on


def test_output_or_a_staging_folder_inside_another_dataset(ws):
    unchanged(ws, pack_args(ws / "in.jsonl", ws / "data" / "more"), "lies inside the dataset")
    unchanged(ws, ["synth", ws / "data" / "plans" / "s", "--dist", "wlb", "--num-seqs", 1, "--context-len", 64],
              "lies inside the dataset")
    for name in (".flashcp-replacement", ".flashcp-replaced"):
        (ws / "data" / name).mkdir()
        (ws / "data" / name / "mine.txt").write_text("mine")
        unchanged(ws, pack_args(ws / "in.jsonl", ws / "data", "--force", context_len=32), name,
                  "was not made by flashcp")
        (ws / "data" / name / "mine.txt").unlink()
        (ws / "data" / name).rmdir()


# ---- 5. hostile records and files, numbers out of range ----

def test_a_deeply_nested_line_is_one_bad_record(ws):
    path = write_jsonl(ws / "deep.jsonl", docs(20))
    with open(path, "a") as f:
        f.write("[" * 100_000 + "]" * 100_000 + "\n")
    result = run(*pack_args(path, ws / "deep"))
    assert result.exit_code == 0, result.output
    assert Dataset(ws / "deep").manifest["counts"]["records_skipped"]["invalid_json"] == 1
    unchanged(ws, pack_args(path, ws / "strict", "--strict"), "deep.jsonl line 21 is not a JSON object")


def test_a_pattern_reaching_a_fifo_or_a_device_skips_it(ws):
    folder = ws / "g"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", docs(20))
    os.mkfifo(folder / "fifo.jsonl")
    (folder / "zero.jsonl").symlink_to("/dev/zero")
    command = [sys.executable, "-c", "from flashcp.cli import main; main()",
               *map(str, pack_args(f"{folder}/*", ws / "out"))]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert [Path(i["path"]).name for i in Dataset(ws / "out").manifest["inputs"]] == ["a.jsonl"]


@pytest.mark.parametrize("command, needle", [
    (["audit", "{d}", "--plan", "cp2-llama3", "--time-limit", "nan"], "--time-limit must be a finite number"),
    (["audit", "{d}", "--plan", "cp2-llama3", "--comm-weight", "nan"], "--comm-weight must be a finite number"),
    (["audit", "{d}", "--plan", "cp2-llama3", "--time-limit", "inf"], "--time-limit must be a finite number"),
    (["plan", "{d}", "--cp", 2, "--strategy", "magi", "--chunk-size", 2**64],
     "chunk size must be a positive integer of at most"),
    (["plan", "{d}", "--cp", 2, "--strategy", "flashcp2", "--token-slack", "nan"], "token slack must be a number"),
    (["synth", "{ws}/s", "--dist", "{ws}/d.json", "--num-seqs", 2, "--context-len", 64],
     "holds the document length 100000000000000000000"),
    (["synth", "{ws}/s", "--dist", "wlb", "--num-seqs", 1, "--context-len", MAX_CONTEXT_LEN + 1],
     "is above the longest context flashcp plans, 16,777,216 tokens (2^24)"),
    (["synth", "{ws}/s", "--dist", "wlb", "--num-seqs", 1, "--context-len", 10**20],
     "is above the longest context flashcp plans"),
    (pack_args("{ws}/in.jsonl", "{ws}/p", context_len=MAX_CONTEXT_LEN + 1), "is above the longest context"),
    (["bench", "--scenario", "quality", "--context-len", MAX_CONTEXT_LEN + 1], "--context-len 16,777,217 is above"),
])
def test_numbers_out_of_range(ws, command, needle):
    (ws / "d.json").write_text("[100000000000000000000, 5]")
    command = [str(a).replace("{d}", str(ws / "data")).replace("{ws}", str(ws)) for a in command]
    unchanged(ws, command, needle)


def test_plan_refuses_a_context_above_the_limit(ws):
    path = ws / "data" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["context_len"] = MAX_CONTEXT_LEN + 1
    for entry in manifest["files"]:
        entry["tokens"] = entry["rows"] * manifest["context_len"]
    path.write_text(json.dumps(manifest))
    unchanged(ws, ["plan", ws / "data", "--cp", 2, "--strategy", "llama3", "--name", "x"], "(2^24)")


# ---- 6. --json: one document on stdout, also on failure ----

@pytest.mark.parametrize("command", [
    ["plan", "{ws}/missing", "--cp", 2], ["show", "{d}", "--seq", 10**6], ["ls", "{ws}/missing"],
    ["verify", "{ws}/missing"], pack_args("{ws}/missing.jsonl", "{ws}/p"),
    ["plan", "{d}", "--cp", 2, "--strategy", "llama3", "--compare", 0],  # exists already, made otherwise
])
def test_json_on_failure(ws, command):
    command = [str(a).replace("{d}", str(ws / "data")).replace("{ws}", str(ws)) for a in command] + ["--json"]
    before = tree(ws)
    result = run(*command)
    err = one_sentence(result)
    assert tree(ws) == before
    document = json.loads(result.stdout)  # exactly one document: json.loads refuses anything after it
    assert document == {"ok": False, "error": err.removeprefix("error: ").strip()}


def test_json_on_a_failed_verify_and_a_usage_error(ws):
    path = ws / "data" / "plans" / "cp2-llama3" / "part-00001.parquet"
    path.write_bytes(path.read_bytes() + b"x")
    result = run("verify", ws / "data", "--json")
    document = json.loads(result.stdout)
    assert result.exit_code == 1 and not document["ok"] and document["error"] == document["problems"][0]
    result = run("plan", ws / "data", "--json")  # no --cp: click's usage error, exit 2, and the document
    assert result.exit_code == 2 and json.loads(result.stdout) == {"ok": False, "error": "Missing option '--cp'."}
    assert json.loads(run("ls", ws / "data", "--json").stdout)["ok"] is True


# ---- 7. metadata that disagrees with the files' own footers ----

def test_manifest_rows_against_the_footers(ws):
    path = ws / "data" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"][0]["rows"] += 1
    manifest["files"][0]["tokens"] += manifest["context_len"]
    manifest["num_sequences"] += 1
    path.write_text(json.dumps(manifest))
    needle = "holds 4 rows by its own footer but the manifest records 5"
    for command in (["show", ws / "data"], ["plan", ws / "data", "--cp", 2, "--strategy", "llama3", "--force"]):
        unchanged(ws, command, needle)
    before = tree(ws)
    for fast in ([], ["--fast"]):  # verify reports every problem: this one, and the plan that no longer fits
        result = run("verify", ws / "data", *fast)
        lines = result.stderr.splitlines()
        assert result.exit_code == 1 and needle in lines[0] and "records 4 rows for data file" in lines[1], lines
        assert len(lines) == 2 and "Traceback" not in result.output and tree(ws) == before
    result = run("ls", ws / "data")
    assert result.exit_code == 0 and needle in result.stderr and result.stderr.count("\n") == 1
    from flashcp.runtime import CPLoader

    with pytest.raises(FlashcpError, match=needle):
        CPLoader(ws / "data", plan="cp2-llama3", rank=0, world_size=2)
    manifest["files"][0]["tokens"] += 1  # rows and tokens that cannot agree: damaged
    path.write_text(json.dumps(manifest))
    unchanged(ws, ["show", ws / "data"], "manifest.json is damaged", "tokens in 5 rows of 64")


def test_plan_json_against_its_plan_files(ws):
    from flashcp.runtime import CPLoader

    path = ws / "data" / "plans" / "cp2-llama3" / "plan.json"
    meta = json.loads(path.read_text())
    path.write_text(json.dumps({**meta, "cp": 8}))
    needle = "was made for cp 2 but plan.json says cp 8"
    for command in (["show", ws / "data", "--plan", "cp2-llama3"], ["verify", ws / "data", "--fast"]):
        unchanged(ws, command, needle)
    with pytest.raises(FlashcpError, match=needle):
        CPLoader(ws / "data", plan="cp2-llama3", rank=5, world_size=8)
    plan_files = [dict(f, rows=f["rows"] + (i == 0)) for i, f in enumerate(meta["plan_files"])]
    path.write_text(json.dumps({**meta, "plan_files": plan_files}))
    unchanged(ws, ["show", ws / "data", "--plan", "cp2-llama3"], "records 5 rows for data file")


def test_plan_files_without_cp_in_their_footer_are_checked_as_read(ws):
    """Plan files written before the footer recorded ``cp``: a batch for a rank the plan never names is refused."""
    from flashcp.fileio import parquet_fingerprint, sha256_file
    from flashcp.runtime import CPLoader

    folder = ws / "data" / "plans" / "cp2-llama3"
    meta = json.loads((folder / "plan.json").read_text())
    for entry in meta["plan_files"]:  # rewritten the way they were written before, fingerprints updated
        table = pq.read_table(folder / entry["path"]).replace_schema_metadata(None)
        pq.write_table(table, folder / entry["path"], compression="zstd", row_group_size=4096,
                       write_statistics=False, store_schema=True)
        entry["bytes"], entry["footer_sha256"] = parquet_fingerprint(folder / entry["path"])
        entry["sha256"] = sha256_file(folder / entry["path"])
    (folder / "plan.json").write_text(json.dumps(meta))
    assert run("verify", ws / "data").exit_code == 0  # still a good plan
    (folder / "plan.json").write_text(json.dumps({**meta, "cp": 8}))
    loader = CPLoader(ws / "data", plan="cp2-llama3", rank=5, world_size=8)
    with pytest.raises(PlanError, match="does not give every one of its cp 8 ranks its equal-token quota"):
        next(iter(loader))


def _rewrite_plan_row(ws, row: int, column: str, change) -> None:
    """Change ``column`` of ``row`` of the first plan file; its fingerprints in plan.json updated to match."""
    import pyarrow as pa

    from flashcp.fileio import parquet_fingerprint, sha256_file

    folder = ws / "data" / "plans" / "cp2-llama3"
    meta = json.loads((folder / "plan.json").read_text())
    entry = meta["plan_files"][0]
    table = pq.read_table(folder / entry["path"])
    values = table.column(column).to_pylist()
    change(values[row])
    field = table.schema.get_field_index(column)
    table = table.set_column(field, table.schema.field(field), pa.array(values, table.schema.field(field).type))
    pq.write_table(table, folder / entry["path"], compression="zstd")
    entry["bytes"], entry["footer_sha256"] = parquet_fingerprint(folder / entry["path"])
    entry["sha256"] = sha256_file(folder / entry["path"])
    (folder / "plan.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("column, change, needle", [
    ("shard_start", lambda starts: starts.__setitem__(-1, starts[-1] + 1), "is not covered exactly once"),
    ("shard_doc", lambda docs: docs.__setitem__(0, 1_000_000), "names a document outside"),
])
def test_show_refuses_a_row_its_plan_does_not_cover(ws, column, change, needle):
    """show runs the row check of verify and CPLoader: a plan row that does not cover its documents is refused."""
    from flashcp.runtime import CPLoader

    _rewrite_plan_row(ws, 1, column, change)
    unchanged(ws, ["show", ws / "data", "--plan", "cp2-llama3", "--seq", 1], "does not fit row 1 of data file",
              needle, "re-run 'flashcp plan --force'")
    assert run("show", ws / "data", "--plan", "cp2-llama3", "--seq", 0).exit_code == 0  # other rows still drawn
    result = run("verify", ws / "data")
    assert result.exit_code == 1 and "row 1: the plan" in result.stderr
    with pytest.raises(PlanError, match=needle):
        for batch in CPLoader(ws / "data", plan="cp2-llama3", rank=0, world_size=2, shuffle=False):
            pass


def test_a_plan_keeps_the_profile_it_was_made_with(ws):
    """plan.json records the profile's content: show reads that, not the file, which may change or move."""
    profile = json.loads((ROOT / "flashcp" / "costmodel" / "profiles" / "h100-sxm-nvlink.json").read_text())
    profile["gpus_per_node"] = {"value": 2, "source": "two ranks per node"}
    mine = ws / "victim" / "profile.json"
    mine.write_text(json.dumps(profile))
    assert run("plan", ws / "data", "--cp", 4, "--profile", mine, "--name", "priced").exit_code == 0
    meta = json.loads((ws / "data" / "plans" / "priced" / "plan.json").read_text())
    assert meta["profile"]["content"] == profile and meta["profile"]["path"] == str(mine.resolve())

    def show():
        result = run("show", ws / "data", "--plan", "priced", "--seq", 2, "--json")
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["gpus_per_node"], result.stderr

    assert show()[0] == 2 and "2 ranks per node" in show()[1]
    profile["gpus_per_node"]["value"] = 4  # edited after the plan was made: the plan is still for 2 per node
    mine.write_text(json.dumps(profile))
    assert show()[0] == 2
    mine.rename(ws / "moved.json")  # moved away: show still draws the plan, as verify, ls and the loader do
    assert show()[0] == 2
    assert run("verify", ws / "data").exit_code == 0


# ---- 3. an advertised option that always crashed: --effort ilp[:S] ----

def test_effort_ilp_plans_through_the_cli_and_the_bench_spec(tmp_path, monkeypatch):
    import flashcp.planner.ilp.polish as polish_module

    assert run("synth", tmp_path / "s", "--dist", "wlb", "--num-seqs", 2, "--context-len", 2048,
               "--no-tokens").exit_code == 0
    calls, real = [], polish_module.polish_plan

    def polish(doc_lens, plan, model, seconds, *args):
        calls.append((model.dtype.kind, seconds))  # the objective model, not the token slack
        return real(doc_lens, plan, model, seconds, *args)

    monkeypatch.setattr(polish_module, "polish_plan", polish)
    result = run("plan", tmp_path / "s", "--cp", 2, "--effort", "ilp:1")
    assert result.exit_code == 0, result.output
    assert calls == [("f", 1.0)] * 2
    meta = json.loads((tmp_path / "s" / "plans" / "cp2-flashcp2" / "plan.json").read_text())
    assert meta["params"]["effort"] == "ilp:1" and run("verify", tmp_path / "s").exit_code == 0
    out = tmp_path / "q.json"
    result = run("bench", "--scenario", "quality", "--dist", "wlb", "--cp", 2, "--seqs", 1, "--context-len", 2048,
                 "--strategies", "flashcp2:effort=ilp:1", "--json", out)
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["quality"]["rows"]
    assert [r["strategy"] for r in rows] == ["flashcp2:effort=ilp:1"] and len(calls) == 3


def test_plan_sequence_polishes_with_effort_ilp(monkeypatch):
    """``plan_sequence(..., effort="ilp:S")`` takes the same path as ``plan``: the kernel, then the polish."""
    import numpy as np

    import flashcp.planner.ilp.polish as polish_module
    from flashcp.planner.planning import plan_sequence

    lens = np.array([5000, 300, 1200, 700, 985, 1800], np.int64)
    calls, real = [], polish_module.polish_plan

    def polish(doc_lens, plan, model, seconds, *args):
        calls.append((list(doc_lens), seconds))
        calls.append(real(doc_lens, plan, model, seconds, *args))
        return calls[-1]

    monkeypatch.setattr(polish_module, "polish_plan", polish)
    polished = plan_sequence("flashcp2", lens, 4, effort="ilp:1")
    assert calls[0] == (lens.tolist(), 1.0) and len(calls) == 2
    assert all((getattr(polished, name) == getattr(calls[1], name)).all()
               for name in ("shard_doc", "shard_start", "shard_len", "shard_rank"))
    plan_sequence("flashcp2", lens, 4, effort=1)
    assert len(calls) == 2  # a plain effort does not polish
