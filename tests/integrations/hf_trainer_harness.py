"""What the CPTrainer tests share (``test_hf_trainer``, ``test_hf_hybrid``): the planned dataset, the loader's
stream order, torchrun launches of ``tests/hf_trainer_worker.py`` and the comparison with one process.

Tolerances (float32, see ``test_hf_trainer``'s docstring for the measurements behind them): logged losses within
``LOSS_TOL``, grad norms within ``GRAD_NORM_RTOL`` relative, parameters within ``PARAM_TOL`` (1% of the learning
rate).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import numpy as np
import torch

from flashcp.runtime import CPLoader
from tests.dist import torchrun
from tests.equivalence import planned_dataset
from tests.hf_trainer_worker import LR, SEED

REPO = Path(__file__).resolve().parents[2]
CONTEXT, NUM_SEQS = 256, 8
LOSS_TOL, GRAD_NORM_RTOL, PARAM_TOL = 1e-5, 1e-5, 1e-2 * LR


def planned_sequences(root: Path) -> tuple[Path, dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]]:
    """Write the dataset (plans ``cp1``, ``cp2``, ``cp4``, flashcp strategy) at ``root``; its sequences by (file, row).

    Row 1 holds one-token documents and one long document spread over every rank.
    """
    from flashcp.planner.planning import plan_sequence

    plans = {f"cp{cp}": (partial(plan_sequence, "flashcp"), cp) for cp in (1, 2, 4)}
    sequences = planned_dataset(root, CONTEXT, plans, seed=5, num_seqs=NUM_SEQS, cuts=(3, 9),
                                fixed_rows={1: np.r_[1, 1, 200, 54]}, row_group_rows=4, vocab_size=64)
    return root, {(0, i): sequence for i, sequence in enumerate(sequences)}


def stream_order(root, count: int, *, shuffle: bool) -> list[tuple[int, int]]:
    """(file, row) of the first ``count`` sequences of the loader's global stream (seed ``SEED``)."""
    loader = CPLoader(root, "cp1", 0, 1, seed=SEED, shuffle=shuffle)
    order: list[tuple[int, int]] = []
    while len(order) < count:
        order += [(b.file_index, b.row) for b in loader]
    return order[:count]


def launch(world: int, root, out: Path, cases: list[dict]) -> dict[str, dict]:
    """Run ``cases`` on ``world`` torchrun gloo ranks; returns each case's result saved by rank 0."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "spec.json"
    spec.write_text(json.dumps({"data": str(root), "out": str(out), "cases": cases}))
    returncode, output = torchrun(REPO / "tests" / "hf_trainer_worker.py", spec, nproc=world, timeout=600)
    assert returncode == 0, output[-5000:]
    return {case["name"]: torch.load(out / f"{case['name']}.pt", weights_only=False) for case in cases}


def max_errors(result, reference) -> tuple[float, float, float]:
    """Max |loss error|, max relative grad-norm error (before clipping, per step), max |parameter error|."""
    ref_log, ref_params = reference
    log = [entry for entry in result["log_history"] if "loss" in entry]
    assert len(log) == len(ref_log), (log, ref_log)
    loss_err = max(abs(a["loss"] - b["loss"]) for a, b in zip(log, ref_log))
    grad_err = max(abs(a["grad_norm"] / b["grad_norm"] - 1) for a, b in zip(log, ref_log))
    param_err = max((result["params"][n] - p).abs().max().item() for n, p in ref_params.items())
    return loss_err, grad_err, param_err


def check_equal(result, reference, where: str, loss_tol: float = LOSS_TOL, grad_tol: float = GRAD_NORM_RTOL,
                param_tol: float = PARAM_TOL):
    assert "error" not in result, f"{where}: {result.get('error')}"
    loss_err, grad_err, param_err = max_errors(result, reference)
    print(f"{where}: max |loss err| {loss_err:.2e}, grad norm {grad_err:.2e}, max |param err| {param_err:.2e}")
    assert loss_err < loss_tol and grad_err < grad_tol and param_err < param_tol, \
        f"{where}: max |loss err| {loss_err:.2e}, max relative grad-norm err {grad_err:.2e}, max |param err| " \
        f"{param_err:.2e}"
