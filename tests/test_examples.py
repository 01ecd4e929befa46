"""The examples themselves, as a user launches them: each under torchrun on 2 gloo ranks, ending cleanly.

A process group still alive at interpreter exit can abort a rank (SIGABRT) while its peer tears down, so
every example destroys its group in a ``finally`` (checked in the source of each one) and each run must exit 0
with no traceback.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashcp.cli import cli
from tests.dist import free_port

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.py"))
TINY = ["--layers", "1", "--heads", "2", "--kv-heads", "1", "--dim", "16"]


def _destroys_in_finally(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Try):
            for call in (n for stmt in node.finalbody for n in ast.walk(stmt) if isinstance(n, ast.Call)):
                if getattr(call.func, "attr", None) == "destroy_process_group":
                    return True
    return False


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_destroys_its_process_group_in_a_finally(path):
    assert _destroys_in_finally(path), f"{path.name} must call destroy_process_group in a finally block"


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """8 sequences of 256 tokens (vocabulary 1024, what hf_trainer.py's model takes) with a cp2 plan."""
    root = tmp_path_factory.mktemp("examples") / "data"
    runner = CliRunner()
    for args in (["synth", root, "--dist", "wlb", "--num-seqs", 8, "--context-len", 256, "--vocab-size", 1024],
                 ["plan", root, "--cp", 2, "--strategy", "llama3"]):
        result = runner.invoke(cli, [str(a) for a in args])
        assert result.exit_code == 0, result.output
    return root


def _torchrun(script: str, *args, timeout: int = 300) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), str(REPO / "examples" / script), *map(str, args)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=REPO, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{script} did not finish within {timeout} s:\n{output[-5000:]}")
    assert proc.returncode == 0 and "Traceback" not in output and "SIGABRT" not in output, output[-5000:]
    return output


def test_cp_attention_demo(planned):
    output = _torchrun("cp_attention_demo.py", planned, "cp2-llama3", "--steps", 1, "--vocab", 64, *TINY)
    assert "step 0:" in output


def test_train_tiny(planned):
    output = _torchrun("train_tiny.py", planned, "--plan", "cp2-llama3", "--steps", 2, "--prefetch", 0,
                       "--vocab", 64, *TINY)
    assert "step 2/2" in output


def test_hf_trainer(planned, tmp_path):
    pytest.importorskip("transformers")
    output = _torchrun("hf_trainer.py", planned, "cp2-llama3", tmp_path / "out")
    assert (tmp_path / "out" / "checkpoint-4").is_dir(), output[-5000:]
