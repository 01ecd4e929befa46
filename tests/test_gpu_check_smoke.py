"""bench/gpu_check.py at toy size on the CPU: its code paths run and its accuracy check passes."""

import importlib.util
from pathlib import Path


def test_gpu_check_runs_small_on_cpu(capsys):
    path = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main(["--device", "cpu", "--small", "--seqs", "1"]) == 0
    out = capsys.readouterr().out
    assert "torch_varlen                 skipped: not available here" in out
    assert "reference (a2a)" in out and out.rstrip().splitlines()[-1].startswith("PASS")
