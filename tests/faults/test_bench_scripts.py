"""The fault suite, files the scripts under scripts/ write: each goes through the commands' output check.

Every script that writes a file a user names (``--json FILE``, ``--out DIR``, ``OUT``, ``OUT_DIR``) is pointed at
a dataset's own files and at a user's file. Each must refuse before any work: exit 1, one sentence on stderr,
no traceback, and the whole tree byte-identical afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.faults.workspace import ROOT, run, tree

# script, its arguments with {target} where the path goes, where the path goes
SCRIPTS = [
    ("cpsat_room.py", ["--dists", "wlb", "--cp", "2", "--seqs", "1", "--context-len", "4096", "--time-limit", "1",
                       "--json", "{target}"]),
    ("torchtitan_kv.py", ["--context-len", "4096", "--num-seqs", "1", "--cp", "2", "--json", "{target}"]),
    ("cache_pairs.py", ["--strategies", "llama3", "--json", "{target}"]),
    ("bf16_dkv.py", ["--cp", "2", "--context-len", "64", "--seeds", "1", "--json", "{target}"]),
    ("pack_throughput.py", ["--json", "{target}"]),
    ("plan_speed.py", ["--json", "{target}"]),
    ("train_throughput.py", ["{data}", "--plans", "cp2-llama3", "--json", "{target}"]),
    ("snapshot.py", ["{target}", "{work}"]),
]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A lengths-only dataset with one plan, and a user's notes beside it."""
    base = tmp_path_factory.mktemp("bench-scripts")
    assert run("synth", base / "data", "--dist", "wlb", "--num-seqs", 2, "--context-len", 4096,
               "--no-tokens", "-q").exit_code == 0
    assert run("plan", base / "data", "--cp", 2, "--strategy", "llama3", "-q").exit_code == 0
    (base / "notes.json").write_text('{"mine": true}\n')
    return base


def _script(name, args, target, base):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [a.format(target=target, data=base / "data", work=base / "work") for a in args]
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *argv], capture_output=True, text=True,
                          cwd=base, env=env, timeout=120)


def _refused(result, *needles):
    err = result.stderr
    assert result.returncode == 1, (result.returncode, result.stdout, err)
    assert "Traceback" not in err and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("name, args", SCRIPTS, ids=[s[0] for s in SCRIPTS])
def test_script_never_writes_a_datasets_file(template, name, args):
    target = template / "data" / ("manifest.json" if len(name) % 2 else "data/part-00000.parquet")
    before = tree(template)
    _refused(_script(name, args, target, template), "lies inside the dataset")
    assert tree(template) == before


@pytest.mark.parametrize("name, args", SCRIPTS[:3], ids=[s[0] for s in SCRIPTS[:3]])
def test_script_never_replaces_a_users_file(template, name, args):
    before = tree(template)
    _refused(_script(name, args, template / "notes.json", template), "flashcp replaces only its own files")
    assert tree(template) == before


def test_snapshot_workdir_never_lies_inside_a_dataset(template):
    before = tree(template)
    _refused(_script("snapshot.py", [str(template / "new.json"), str(template / "data" / "work")], "", template),
             "WORKDIR", "lies inside the dataset")
    assert tree(template) == before


def test_gpu_check_out_never_writes_into_a_dataset(template):
    before = tree(template)
    _refused(_script("gpu_check.py", ["--device", "cpu", "--small", "--out", "{target}"], template / "data",
                     template), "--out", "lies inside the dataset")
    assert tree(template) == before


def test_audit_table2_never_writes_into_a_dataset(template):
    before = tree(template)
    result = subprocess.run(["bash", str(ROOT / "scripts" / "audit_table2.sh"), str(template / "data")],
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            timeout=120)
    _refused(result, "OUT_DIR", "lies inside the dataset")
    assert tree(template) == before
