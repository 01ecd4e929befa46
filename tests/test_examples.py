"""The examples themselves, as a user launches them: each under torchrun on 2 gloo ranks, ending cleanly.

A process group still alive at interpreter exit can abort a rank (SIGABRT) while its peer tears down, so
every example runs inside ``flashcp.train.launch``'s ``torchrun_group()`` or ``ending_together()``, which destroy
the group in a ``finally`` (checked in the source of each example; the helpers in tests/train/test_launch.py),
and each run must exit 0 with no traceback.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashcp.cli import cli
from tests.dist import torchrun

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.py"))
SCRIPTS = [p for p in EXAMPLES if "sys.argv" in p.read_text() or '__name__ == "__main__"' in p.read_text()]
"""The examples a user runs under torchrun (the others are config modules another trainer imports, e.g.
torchtitan_flashcp.py for ``torchtitan.train --module``: that trainer owns the process group)."""
GROUP_ENDINGS = ("torchrun_group", "ending_together")  # flashcp.train.launch: destroy in a finally
TINY = ["--layers", "1", "--heads", "2", "--kv-heads", "1", "--dim", "16"]


def _ends_its_group_with_flashcp(path: Path) -> bool:
    """The script runs its work inside ``with torchrun_group()`` or ``with ending_together()``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.With):
            for item in node.items:
                call = item.context_expr
                if isinstance(call, ast.Call) and getattr(call.func, "id", None) in GROUP_ENDINGS:
                    return True
    return False


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_every_example_ends_its_process_group_through_flashcp_train_launch(path):
    assert _ends_its_group_with_flashcp(path), \
        f"{path.name} must run inside flashcp.train.launch's torchrun_group() or ending_together()"


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


def _torchrun(script: str, *args) -> str:
    returncode, output = torchrun(REPO / "examples" / script, *args)
    assert returncode == 0 and "Traceback" not in output and "SIGABRT" not in output, output[-5000:]
    return output


def test_cp_attention_demo(planned):
    output = _torchrun("cp_attention_demo.py", planned, "cp2-llama3", "--steps", 1, "--vocab", 64, *TINY)
    assert "step 0:" in output


def test_train_tiny(planned):
    output = _torchrun("train_tiny.py", planned, "--plan", "cp2-llama3", "--steps", 2, "--prefetch", 0,
                       "--vocab", 64, *TINY)
    assert "step 2/2" in output


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen3_next", marks=pytest.mark.slow)])
def test_hf_trainer(planned, tmp_path, arch):
    pytest.importorskip("transformers")
    output = _torchrun("hf_trainer.py", planned, "cp2-llama3", tmp_path / "out", "--arch", arch)
    assert (tmp_path / "out" / "checkpoint-4").is_dir(), output[-5000:]
    # the example's own check: the same 4 steps in one process, documents apart (measured 9.5e-7 and 4.8e-7)
    found = re.search(r"largest \|loss difference\| against one process with documents apart: (\S+) over 4 steps",
                      output)
    assert found is not None and float(found.group(1)) < 1e-5, output[-3000:]
