"""The loop's learning-rate schedule (flashcp.train.schedule): its values, its refusals, and exact resumes.

A run of N steps equals one stopped after k steps (a checkpoint) and resumed to N, with the warm-up or the
decay crossing the resume point: the losses bit for bit, the weights and optimizer state equal, in one process
with a checkpoint file and on 2 gloo ranks (CP 2, FSDP2) with a DCP folder.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from flashcp.errors import FlashcpError
from flashcp.train.loop import LRSchedule, run_training
from flashcp.train.schedule import LR_SCHEDULES
from tests.dist import spawn
from tests.train import options

LR = 1e-2


def plain_factor(kind, warmup, floor, horizon, step):
    """The schedule from its definition: linear warm-up from 0, then the decay to ``floor`` at ``horizon``."""
    if step <= warmup:
        return step / warmup
    if kind == "constant":
        return 1.0
    p = min((step - warmup) / (horizon - warmup), 1.0)
    shape = 1.0 - p if kind == "linear" else (1.0 + math.cos(math.pi * p)) / 2.0
    return floor + (1.0 - floor) * shape


@pytest.mark.parametrize("kind", LR_SCHEDULES)
@pytest.mark.parametrize(("warmup", "floor", "decay_steps"), [(0, 0.0, None), (3, 0.1, None), (4, 0.25, 9)])
def test_factor_equals_the_formula(kind, warmup, floor, decay_steps):
    total = 12
    schedule = LRSchedule(kind=kind, warmup_steps=warmup, min_lr_ratio=floor, decay_steps=decay_steps)
    horizon = decay_steps or total
    got = [schedule.factor(s, total) for s in range(1, total + 3)]  # two steps past the end: the floor
    want = [plain_factor(kind, warmup, floor, horizon, s) for s in range(1, total + 3)]
    err = max(abs(a - b) for a, b in zip(got, want))
    assert err < 1e-15, f"max |factor err| {err:.2e}: {got} != {want}"
    if warmup:
        assert got[0] == 1 / warmup and got[warmup - 1] == 1.0
    if kind != "constant":
        assert got[horizon - 1] == pytest.approx(floor) and got[-1] == pytest.approx(floor)


def test_default_is_todays_constant_rate(planned):
    root, _ = planned
    logs = run_training(options(root))
    assert [s.lr for s in logs] == [LR] * 3
    assert LRSchedule().factor(1, 1) == 1.0


@pytest.mark.parametrize(("make", "message"), [
    (lambda: LRSchedule(kind="step"), r"^unknown --lr-schedule 'step' \(choose from constant, cosine, linear\)$"),
    (lambda: LRSchedule(warmup_steps=-1), r"^--warmup-steps must be at least 0, got -1$"),
    (lambda: LRSchedule(min_lr_ratio=1.5), r"^--min-lr-ratio must be between 0 and 1, got 1.5$"),
    (lambda: LRSchedule(decay_steps=0), r"^--decay-steps must be at least 1 \(or unset: the run's steps\), got 0$"),
    (lambda: options(".", steps=3, lr_schedule=LRSchedule(kind="cosine", warmup_steps=3)),
     r"^--lr-schedule cosine decays after the 3 warm-up steps but ends at step 3; give more --steps"),
])
def test_refusals(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def _compare(full, first, second, steps) -> list[str]:
    failures = []
    if [s.step for s in first + second] != list(range(1, steps + 1)):
        failures.append(f"resume ran steps {[s.step for s in first + second]}")
    if [s.loss for s in first + second] != [s.loss for s in full]:
        failures.append(f"resumed losses {[s.loss for s in first + second]} != {[s.loss for s in full]}")
    if [s.lr for s in first + second] != [s.lr for s in full]:
        failures.append(f"resumed learning rates {[s.lr for s in first + second]} != {[s.lr for s in full]}")
    return failures


@pytest.mark.parametrize("kind", ["cosine", "linear"])
@pytest.mark.parametrize("stop", [2, 5], ids=["in-warm-up", "in-decay"])
def test_resume_is_exact(planned, tmp_path, kind, stop):
    root, _ = planned
    steps = 8
    schedule = LRSchedule(kind=kind, warmup_steps=3, min_lr_ratio=0.1, decay_steps=steps)
    full_ckpt, part_ckpt = tmp_path / "full.pt", tmp_path / "part.pt"
    full = run_training(options(root, steps=steps, lr_schedule=schedule, ckpt=str(full_ckpt)))
    first = run_training(options(root, steps=stop, lr_schedule=schedule, ckpt=str(part_ckpt)))
    second = run_training(options(root, steps=steps, lr_schedule=schedule, ckpt=str(part_ckpt), resume=True))
    failures = _compare(full, first, second, steps)
    want = [LR * plain_factor(kind, 3, 0.1, steps, s) for s in range(1, steps + 1)]
    err = max(abs(s.lr - w) for s, w in zip(full, want))
    assert err < 1e-15, f"max |lr err| {err:.2e}: {[s.lr for s in full]} != {want}"
    a, b = (torch.load(p, weights_only=True) for p in (full_ckpt, part_ckpt))
    param_err = max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"])
    moment_err = max((sa[k] - sb[k]).abs().max().item() for sa, sb in zip(a["optimizer"]["state"].values(),
                                                                          b["optimizer"]["state"].values())
                     for k in sa)
    assert not failures and param_err == 0 and moment_err == 0, (
        f"{failures}; max |param err| {param_err:.2e}, max |optimizer state err| {moment_err:.2e}")
    assert a["schedule"] == b["schedule"] == {"lr": LR, "kind": kind, "warmup_steps": 3, "min_lr_ratio": 0.1,
                                              "decay_steps": steps}


def test_resume_with_another_schedule_is_refused(planned, tmp_path):
    root, _ = planned
    ckpt = str(tmp_path / "ck.pt")
    cosine = LRSchedule(kind="cosine", warmup_steps=2)
    run_training(options(root, steps=3, lr_schedule=cosine, ckpt=ckpt))
    with pytest.raises(FlashcpError, match=r"^checkpoint .*ck.pt was trained with another learning-rate schedule: "
                                           r"decay_steps 3 \(now 6\); resume with the same --lr, --lr-schedule"):
        run_training(options(root, steps=6, lr_schedule=cosine, ckpt=ckpt, resume=True))
    with pytest.raises(FlashcpError, match=r"schedule: kind 'cosine' \(now 'linear'\)"):
        run_training(options(root, steps=3, lr_schedule=LRSchedule(kind="linear", warmup_steps=2), ckpt=ckpt,
                             resume=True))
    with pytest.raises(FlashcpError, match=r"schedule: lr 0.01 \(now 0.02\)"):
        run_training(options(root, steps=3, lr=2e-2, lr_schedule=cosine, ckpt=ckpt, resume=True))
    constant = str(tmp_path / "constant.pt")  # a constant rate has no horizon: the run may be extended
    run_training(options(root, steps=2, ckpt=constant))
    assert [s.step for s in run_training(options(root, steps=4, ckpt=constant, resume=True))] == [3, 4]


def _sharded_worker(rank, world, root, ckpt_dir):
    steps, stop = 6, 3
    schedule = LRSchedule(kind="cosine", warmup_steps=2, min_lr_ratio=0.2, decay_steps=steps)
    base = dict(plan="cp2-llama3-like", sharding="fsdp", lr_schedule=schedule, comm="a2a")
    full_ckpt, part_ckpt = f"{ckpt_dir}/full", f"{ckpt_dir}/part"
    full = run_training(options(root, **base, steps=steps, ckpt=full_ckpt))
    first = run_training(options(root, **base, steps=stop, ckpt=part_ckpt, prefetch=0))
    second = run_training(options(root, **base, steps=steps, ckpt=part_ckpt, resume=True))
    failures = _compare(full, first, second, steps)
    a, b = (json.loads((Path(p) / "flashcp.json").read_text()) for p in (full_ckpt, part_ckpt))
    if a != b:
        failures.append(f"checkpoint state {b} after resuming, {a} uninterrupted")
    return failures


def test_resume_is_exact_from_a_sharded_checkpoint(planned, tmp_path):
    root, _ = planned
    spawn(_sharded_worker, 2, str(root), str(tmp_path))


def test_script_takes_the_schedule(planned, capsys):
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "examples" / "train_tiny.py"
    spec = importlib.util.spec_from_file_location("train_tiny", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    root, _ = planned
    shape = ["--plan", "cp1-llama3-like", "--dim", "16", "--heads", "2", "--kv-heads", "1", "--vocab", "16"]
    assert script.main([str(root), *shape, "--steps", "3", "--lr-schedule", "linear", "--warmup-steps", "1"]) == 0
    err = capsys.readouterr().err
    assert "step 1/3" in err and "lr 0.001" in err and "lr 0.0005" in err and "lr 0\n" in err
    assert script.main([str(root), *shape, "--min-lr-ratio", "2"]) == 1
    assert capsys.readouterr().err.strip() == "error: --min-lr-ratio must be between 0 and 1, got 2.0"
