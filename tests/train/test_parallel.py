"""Data parallel x context parallel on a 2-D DeviceMesh of 4 gloo ranks equals one process on the global batch.

One spawn of 4 ranks builds three meshes, DP 2 x CP 2, DP 1 x CP 4 and DP 4 x CP 1, and on each trains, for
the ``flashcp+`` and ``llama3`` plans, the tiny model and a stock transformers Llama, with FSDP2
(``fully_shard`` over the flattened mesh) and with replicated weights plus an all-reduce: three AdamW steps
in float64 must give the losses and parameters of three single-process steps on the same global batches
(the next ``dp`` sequences of the stream each step; the loss is the global batch's token-mean), to 1e-10.
Six sequences make the DP 4 run straddle an epoch's end. The same spawn checks the DCP checkpoint's exact
resume and the refusals of a mesh that does not fit the plan.
"""

from __future__ import annotations

import importlib.util
import os
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flashcp.errors import FlashcpError
from flashcp.planner.planning import plan_sequence
from flashcp.runtime import CPLoader
from flashcp.train.loop import TrainOptions, run_training
from flashcp.train.loss import tiny_loss_sum
from flashcp.train.parallel import SHARDING_MODES, ParallelGroups, build_mesh, full_parameters, shard_model
from tests import equivalence
from tests.dist import spawn
from tests.equivalence import (
    equivalence_failure,
    forward_loss_of,
    global_batch_training,
    max_difference,
    planned_dataset,
    refusal_failures,
    resume_failures,
    stream_batches,
    train_steps,
)
from tests.naive import naive_document_attention

HAS_HF = importlib.util.find_spec("transformers") is not None
CONTEXT, NUM_SEQS, STEPS = 64, 6, 3
VOCAB, DIM, LAYERS, HEADS, KV_HEADS = 32, 16, 2, 4, 2
LR, SEED, TOL = 1e-2, 5, 1e-10
MESHES = ((2, 2), (1, 4), (4, 1))
STRATEGIES = ("flashcp+", "llama3")
MODELS = ("tiny", "llama") if HAS_HF else ("tiny",)
COMMS = ("allgather", "a2a", "full")


SHAPE = dict(vocab_size=VOCAB, dim=DIM, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS)
make_model = partial(equivalence.make_model, seed=SEED, **SHAPE)


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    root = tmp_path_factory.mktemp("mesh") / "data"
    plans = {f"cp{cp}-{strategy}": (partial(plan_sequence, strategy), cp)
             for cp in sorted({cp for _, cp in MESHES} | {2}) for strategy in STRATEGIES}
    sequences = planned_dataset(root, CONTEXT, plans, seed=21, num_seqs=NUM_SEQS, cuts=(1, 6),
                                fixed_rows={2: np.array([CONTEXT])}, row_group_rows=4)  # row 2: one document
    # the global batch of a step: the stream's next dp sequences; its loss: token-mean over the global batch
    references = {(dp, kind): global_batch_training(make_model(kind, cp=False), forward_loss_of(kind),
                                                    stream_batches(sequences, dp, STEPS), vocab_size=VOCAB, lr=LR)
                  for dp in sorted({dp for dp, _ in MESHES}) for kind in MODELS}
    return str(root), references


def _cases():
    cases = [(strategy, kind, mode) for strategy in STRATEGIES for kind in MODELS for mode in SHARDING_MODES]
    return [(*case, COMMS[i % len(COMMS)]) for i, case in enumerate(cases)]


def _train(root, groups, mesh, strategy, kind, mode, comm, steps):
    model = shard_model(make_model(kind, cp=True), groups, mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    # the stream order (no DP balance): the reference trains the stream's consecutive sequences
    loader = CPLoader.from_mesh(root, f"cp{groups.cp_size}-{strategy}", mesh, shuffle=False, balance_window=0)
    if kind == "tiny":
        loss_sum_fn = tiny_loss_sum
    else:
        from flashcp.integrations.hf import hf_loss_sum as loss_sum_fn
    losses = train_steps(model, optimizer, loader, loss_sum_fn, steps=steps, vocab_size=VOCAB, groups=groups,
                         comm=comm)
    return losses, model


def _worker(rank, world, root, references, ckpt_dir):
    failures = []
    for dp, cp in MESHES:
        mesh = build_mesh(dp, cp)
        groups = ParallelGroups.from_mesh(mesh)
        for strategy, kind, mode, comm in _cases():
            losses, model = _train(root, groups, mesh, strategy, kind, mode, comm, STEPS)
            failures += equivalence_failure(f"dp{dp} x cp{cp} plan={strategy} model={kind} {mode} comm={comm}",
                                            losses, full_parameters(model), references[dp, kind], loss_tol=TOL,
                                            param_tol=TOL)
        if (dp, cp) == (2, 2):
            failures += _refusals(root, mesh)
        if cp > 1:
            failures += _bf16_checks(groups, rank)
    failures += _resume_checks(root, ckpt_dir)
    return failures


def _resume_checks(root, ckpt_dir):
    """The loop on DP 2 x CP 2 with FSDP2 in float32: stop after step 2 (a DCP folder), resume to step 4; steps 3 and 4
    equal the uninterrupted run's bit for bit, and so does the saved loader state."""
    import json

    base = dict(data=root, plan="cp2-flashcp+", model="tiny", dtype="float32", vocab_size=VOCAB, dim=DIM,
                num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, lr=LR, seed=3, dp=2,
                sharding="fsdp", comm="a2a")
    full_ckpt, part_ckpt = f"{ckpt_dir}/full", f"{ckpt_dir}/part"
    failures = resume_failures(run_training, partial(TrainOptions, **base), steps=4, stop=2, full_ckpt=full_ckpt,
                               part_ckpt=part_ckpt, first_overrides=dict(prefetch=0))
    a, b = (json.loads((Path(p) / "flashcp.json").read_text()) for p in (full_ckpt, part_ckpt))
    if a != b:
        failures.append(f"checkpoint state {b} after resuming, {a} uninterrupted")
    if a["loader"]["epoch"] * NUM_SEQS + a["loader"]["position"] != 4 * 2:
        failures.append(f"after 4 steps of dp 2 the loader stands at {a['loader']}, not 8 sequences in")
    failures += refusal_failures([
        (lambda: run_training(TrainOptions(**dict(base, dim=2 * DIM), steps=5, ckpt=part_ckpt, resume=True)),
         FlashcpError, "was made by a different run: dim 16 (now 32)")])
    failures += _missing_shard_checks(base, part_ckpt)
    return failures


def _missing_shard_checks(base: dict, ckpt: str) -> list[str]:
    """Fault suite, on every rank: a DCP folder missing a shard is refused with the same one sentence."""
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        os.replace(Path(ckpt) / "__3_0.distcp", Path(ckpt) / "moved.distcp")
    dist.barrier()
    try:
        run_training(TrainOptions(**base, steps=5, ckpt=ckpt, resume=True))
        failures = ["a checkpoint missing a shard was resumed"]
    except FlashcpError as e:
        wanted = f"checkpoint {ckpt} is incomplete: its shard __3_0.distcp is missing; restore the folder"
        failures = [] if str(e).startswith(wanted) and "\n" not in str(e) else [f"missing shard: '{e}'"]
    dist.barrier()
    if dist.get_rank() == 0:
        os.replace(Path(ckpt) / "moved.distcp", Path(ckpt) / "__3_0.distcp")
    return failures


def _bf16_checks(groups, rank):
    """bf16 dK/dV of every comm mode on this mesh's CP groups: relative L2 error at most 1.2x that of plain
    bf16 SDPA on the whole sequence (partial dK/dV are summed in float32); ``scripts/bf16_dkv.py`` measures more.
    """
    from flashcp.runtime import CPAttnMeta, cp_attention
    from flashcp.runtime.meta import rank_token_positions

    failures = []
    cp, cp_rank = groups.cp_size, rank % groups.cp_size
    context = 512
    gen = torch.Generator().manual_seed(0)
    for name, doc_lens in (("single-doc", np.array([context])),
                           ("many-doc", np.array([40, 3, 150, 77, 1, 200, 41]))):
        q, k, v, dout = (torch.randn(context, h, 32, generator=gen, dtype=torch.float64) for h in (4, 2, 2, 4))
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = torch.autograd.grad(naive_document_attention(*ref_in, doc_lens), ref_in, dout)
        base_in = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
        groups_ = q.shape[1] // k.shape[1]
        doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.as_tensor(doc_lens))
        pos = torch.arange(context)
        keep = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
        base_out = F.scaled_dot_product_attention(
            base_in[0].transpose(0, 1), base_in[1].repeat_interleave(groups_, 1).transpose(0, 1),
            base_in[2].repeat_interleave(groups_, 1).transpose(0, 1), attn_mask=keep).transpose(0, 1)
        base = torch.autograd.grad(base_out, base_in, dout.to(torch.bfloat16))
        plan = plan_sequence("perdoc", doc_lens, cp)
        meta = CPAttnMeta.from_plan(plan, doc_lens, cp_rank)
        mine = torch.from_numpy(rank_token_positions(plan, doc_lens, cp_rank)[0])
        for comm in ("allgather", "a2a", "full", "ring"):
            inputs = [t[mine].to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
            out = cp_attention(*inputs, meta, group=groups.cp_group, comm=comm, backend="reference")
            grads = torch.autograd.grad(out, inputs, dout[mine].to(torch.bfloat16))
            for label, index in (("dk", 1), ("dv", 2)):
                full = torch.zeros_like(ref[index])
                full[mine] = grads[index].double()
                torch.distributed.all_reduce(full, group=groups.cp_group)  # disjoint slices: the whole tensor
                err = ((full - ref[index]).norm() / ref[index].norm()).item()
                base_err = ((base[index].double() - ref[index]).norm() / ref[index].norm()).item()
                if not err <= 1.2 * base_err:
                    failures.append(f"bf16 cp{cp} {name} {comm} {label}: relative error {err:.2e} is "
                                    f"{err / base_err:.2f}x plain bf16 SDPA's {base_err:.2e}")
    return failures


def _refusals(root, mesh):
    options = dict(data=root, model="tiny", dtype="float64", vocab_size=VOCAB, dim=DIM, num_layers=LAYERS,
                   num_heads=HEADS, num_kv_heads=KV_HEADS, steps=1)
    return refusal_failures([
        (lambda: CPLoader.from_mesh(root, "cp4-llama3", mesh), FlashcpError,
         "made for cp 4 but the device mesh's 'cp'"),
        (lambda: CPLoader.from_mesh(root, "cp2-llama3", mesh, dp_dim="data"), FlashcpError,
         "but the loader needs 'data'"),
        (lambda: run_training(TrainOptions(**options, plan="cp2-llama3", dp=3)), FlashcpError,
         "--dp 3 does not divide the 4 ranks launched; launch dp x cp ranks"),
        (lambda: run_training(TrainOptions(**options, plan="cp4-llama3", dp=2)), FlashcpError,
         "plan 'cp4-llama3' was made for cp 4 but the device mesh's 'cp' dimension has 2 ranks; build the "
         "mesh with cp 4 or run 'flashcp plan --cp 2'")])


@pytest.mark.slow
def test_dp_x_cp_on_a_mesh_equals_one_process_on_the_global_batch(planned, tmp_path):
    root, references = planned
    spawn(_worker, 4, root, references, str(tmp_path))


def test_the_global_batches_differ_between_dp_sizes(planned):
    # the references for dp 1, 2, 4 are different trainings: equal numbers above are not equal by accident
    _, references = planned
    for kind in MODELS:
        finals = [references[dp, kind].params for dp in (1, 2, 4)]
        for a, b in ((0, 1), (1, 2)):
            moved = max_difference(finals[a], finals[b])
            assert moved > 1e-4, f"{kind}: dp sizes {a} and {b} trained the same parameters"
