"""scripts/gpu_check.py (the GPU timing) at toy size on the CPU: its code paths run and its report is written.

What the GPU check tests (does the runtime work, is it accurate) is tests/runtime/test_gpu_runtime.py.
"""

from tests.bench import bench_script


def test_gpu_timing_runs_small_on_cpu(capsys, tmp_path):
    gpu_check = bench_script("gpu_check")
    assert gpu_check.main(["--device", "cpu", "--small", "--seqs", "1", "--budget", "5", "--out",
                           str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("torch ") and "timing: C=256 cp=4" in out, out
    assert "  wlb    llama3 " in out and "ring+ring" in out, out
    assert out.rstrip().splitlines()[-1].startswith("done")
    assert (tmp_path / "out" / "gpu_check.txt").read_text() == out
    assert '"format": "flashcp-gpu-check"' in (tmp_path / "out" / "gpu_check.json").read_text()
