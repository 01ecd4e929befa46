"""DP x CP training with DP step balance, gradient accumulation and clipping equals one process on the same global
batches.

DP 2 x CP 2 on 4 gloo ranks, the tiny model in float64: every optimizer step takes ``ACCUM`` micro-batches on each
replica from ``CPLoader`` with ``balance_window`` 2 (so the global batches are the balanced grouping, not the
stream's consecutive sequences), the loss of each is its token-loss sum over the label tokens of the whole global
batch, and the update is clipped to a global gradient norm that the reference run does exceed. ``train_step`` with
replicated weights and with FSDP2, and the training loop (``run_training``), must give the losses, gradient norms
and parameters of one process that trains each global batch whole (summed token losses over its labels,
``clip_grad_norm_``, AdamW), to 1e-10.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashcp.models.tiny import TinyConfig, TinyDecoder
from flashcp.planner.planning import plan_sequence
from flashcp.runtime import CPLoader
from flashcp.train import fold_vocab, train_step
from flashcp.train.loop import TrainOptions, run_training
from flashcp.train.loss import tiny_loss_sum
from flashcp.train.parallel import ParallelGroups, build_mesh, full_parameters, shard_model
from tests.dist import spawn
from tests.equivalence import (
    Reference,
    batches_forever,
    global_batch_training,
    loss_error,
    max_errors,
    tiny_forward_loss,
)
from tests.plans import write_dataset, write_plan

CONTEXT, NUM_SEQS, STEPS, ACCUM, WINDOW = 64, 10, 3, 2, 2
DP, CP = 2, 2
VOCAB, DIM, LAYERS, HEADS, KV_HEADS = 32, 16, 2, 4, 2
LR, SEED, TOL, CLIP = 1e-2, 5, 1e-10, 0.31
PLAN = f"cp{CP}-flashcp+"


def make_model() -> torch.nn.Module:
    """The model ``run_training`` builds for the options below (seeded, float32 init, then float64)."""
    torch.manual_seed(SEED)
    cfg = TinyConfig(vocab_size=VOCAB, dim=DIM, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
                     ffn_dim=2 * DIM)
    return TinyDecoder(cfg).to(torch.float64)


def global_batches(root) -> list[list[int]]:
    """Global row indices of each optimizer step's global batch, from every replica's loader."""
    loaders = [CPLoader(root, PLAN, 0, CP, dp_rank=d, dp_size=DP, seed=SEED, balance_window=WINDOW)
               for d in range(DP)]
    iters = [iter(loader) for loader in loaders]
    steps = []
    for _ in range(STEPS):
        rows = []
        for _ in range(ACCUM):
            for d, loader in enumerate(loaders):
                batch = next(iters[d], None)
                if batch is None:
                    iters[d] = iter(loader)
                    batch = next(iters[d])
                rows.append(batch.row)  # one data file
        steps.append(rows)
    return steps


def reference_training(sequences, steps) -> Reference:
    """One process: each global batch whole, loss = summed token losses / its labels, clipped, AdamW."""
    return global_batch_training(make_model(), tiny_forward_loss, [[sequences[row] for row in rows] for rows in steps],
                                 vocab_size=VOCAB, lr=LR, max_grad_norm=CLIP)


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    root = tmp_path_factory.mktemp("accumulation") / "data"
    rng = np.random.default_rng(31)
    rows = []
    for i in range(NUM_SEQS):  # one-document sequences beside many-document ones: costs that differ
        cuts = np.sort(rng.choice(np.arange(1, CONTEXT), size=int(rng.integers(0, 8)) if i % 3 else 0,
                                  replace=False))
        rows.append(np.diff(np.r_[0, cuts, CONTEXT]))
    dataset, tokens = write_dataset(root, [rows], CONTEXT, rng, row_group_rows=4)
    write_plan(dataset, PLAN, [[plan_sequence("flashcp+", lens, CP) for lens in rows]], CP)
    steps = global_batches(str(root))
    sequences = list(zip(tokens[0], rows))
    return str(root), steps, sequences, reference_training(sequences, steps)


def test_the_global_batches_are_balanced_and_the_reference_clips(planned):
    root, steps, _, (_, norms, _) = planned
    flat = [r for s in steps for r in s]
    assert sorted(flat[:NUM_SEQS]) == list(range(NUM_SEQS)), "every sequence once"
    stream = [b.row for b in CPLoader(root, PLAN, 0, CP, seed=SEED)]
    assert flat[:2 * DP * ACCUM] != stream[:2 * DP * ACCUM], "the balanced grouping differs from the stream's"
    assert max(norms) > CLIP, f"the reference never clips (norms {norms}): the test would not check clipping"


def _worker(rank, world, root, steps, reference):
    ref_losses, ref_norms, _ = reference
    failures = []
    mesh = build_mesh(DP, CP)
    groups = ParallelGroups.from_mesh(mesh)
    for mode in ("replicate", "fsdp"):
        model = shard_model(make_model(), groups, mode)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        loader = CPLoader.from_mesh(root, PLAN, mesh, seed=SEED, balance_window=WINDOW)
        batches = batches_forever(loader)
        losses, norms, rows = [], [], []
        for _ in range(STEPS):
            micro = [next(batches) for _ in range(ACCUM)]
            rows += [batch.row for batch in micro]
            micro = [fold_vocab(batch, VOCAB) for batch in micro]
            result = train_step(model, optimizer, micro, tiny_loss_sum, groups=groups, comm="a2a",
                                max_grad_norm=CLIP)
            losses.append(result.loss)
            norms.append(result.grad_norm)
        loss_err, param_err = max_errors(losses, full_parameters(model), reference)
        norm_err = loss_error(norms, ref_norms)
        if not (loss_err < TOL and norm_err < TOL and param_err < TOL):
            failures.append(f"train_step {mode}: max |loss err| {loss_err:.2e}, |norm err| {norm_err:.2e}, "
                            f"|param err| {param_err:.2e}")
        mine = [row for s in range(STEPS) for row in
                [steps[s][a * DP + mesh.get_local_rank("dp")] for a in range(ACCUM)]]
        if rows != mine:
            failures.append(f"{mode}: replica {mesh.get_local_rank('dp')} trained rows {rows}, the global "
                            f"batches say {mine}")
    options = TrainOptions(data=root, plan=PLAN, steps=STEPS, model="tiny", dtype="float64", vocab_size=VOCAB,
                           dim=DIM, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, lr=LR, seed=SEED,
                           dp=DP, comm="allgather", accum_steps=ACCUM, max_grad_norm=CLIP, balance_window=WINDOW,
                           weight_decay=0.01)  # torch.optim.AdamW's default, which the reference uses
    logs = run_training(options)
    loss_err = loss_error([log.loss for log in logs], ref_losses)
    norm_err = loss_error([log.grad_norm for log in logs], ref_norms)
    if not (loss_err < TOL and norm_err < TOL):
        failures.append(f"run_training: max |loss err| {loss_err:.2e}, |norm err| {norm_err:.2e}")
    if logs[0].num_tokens != CONTEXT * DP * ACCUM:
        failures.append(f"a step counts {logs[0].num_tokens} tokens, not {CONTEXT * DP * ACCUM}")
    return failures


def test_dp_cp_with_balance_accumulation_and_clipping_equals_one_process(planned):
    root, steps, _, reference = planned
    spawn(_worker, DP * CP, root, steps, reference)


def test_train_step_refusals(planned):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        train_step(model, optimizer, [])
    batch = next(iter(CPLoader(planned[0], PLAN, 0, CP)))
    with pytest.raises(ValueError, match="max_grad_norm must be positive"):
        train_step(model, optimizer, batch, max_grad_norm=0.0)
    with pytest.raises(ValueError, match="--accum must be at least 1"):
        TrainOptions(data="d", plan="p", steps=1, accum_steps=0)
