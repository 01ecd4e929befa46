"""bench/gpu_check.py at toy size on the CPU: its code paths run and its checks pass, also through the
emulated GPU backends of tests/fake_kernels.py on a device that says compute capability 9.0."""

import importlib.util
from pathlib import Path

import torch

from tests import fake_kernels


def load_gpu_check():
    path = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    return gpu_check


def test_gpu_check_runs_small_on_cpu(capsys, tmp_path):
    gpu_check = load_gpu_check()
    assert gpu_check.main(["--device", "cpu", "--small", "--seqs", "1", "--budget", "5", "--out",
                           str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "torch_varlen                 skipped: not available here" in out
    assert "reference (a2a)" in out and out.rstrip().splitlines()[-1].startswith("PASS")
    assert (tmp_path / "out" / "gpu_check.txt").read_text() == out
    assert '"pass": true' in (tmp_path / "out" / "gpu_check.json").read_text()


def test_first_section_through_the_emulated_backends(capsys):
    gpu_check = load_gpu_check()
    undo = fake_kernels.install("fa3", "fa4", "flash_attn-2.8", "torch_varlen")
    try:
        assert gpu_check.does_it_work(torch.device("cpu"), small=True)
    finally:
        undo()
    out = capsys.readouterr().out
    assert "auto on cpu bf16 D=128: fa3 (ring: fa3); float32: reference" in out
    for backend in ("fa3", "fa4", "flash_attn", "torch_varlen"):
        assert f"  {backend:<13} available" in out
        assert f"  {backend:<13} {'ring forward+backward':<34} ok" in out
        assert f"  {backend:<13} {'LSE, length-1 shards, GQA, D=128':<34} ok" in out
    assert "train step (bf16, one rank, sync debug mode): ok" in out
