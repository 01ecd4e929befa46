"""CP recurrent layers on 2 and 4 gloo ranks against the single-process token-by-token reference (float64).

Every rank builds the same cases from the same seed and runs a small layer: the short convolution over the
mixed projections, then the recurrence (Gated DeltaNet as Qwen3-Next, Mamba-2 SSD as Nemotron-H), forward and
backward. Each rank compares its slice of the output and of the inputs' gradients, and the parameters'
gradients summed over the ranks, with the reference run on the whole packed sequence, documents kept apart.
It also records the collectives: per layer one ``all_to_all_single`` of the convolution inputs and one of the
state maps forward, with the meta's splits (each skipped when no row crosses ranks), the same calls with the
splits swapped backward in reverse order, none at all when no document is cut. In
float32 and bf16, the CP layers' error against float64 is bounded by the error of one process running the same
chunked kernels on the whole sequence.
"""

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from flashcp.runtime.meta import rank_token_positions
from flashcp.runtime.recurrent import (
    RecurrentMeta,
    causal_conv1d,
    chunk_gated_delta_rule,
    chunk_ssd,
)
from tests.dist import spawn
from tests.emulate import random_plan
from tests.runtime.recurrent_cases import (
    GDN,
    SSD,
    WIDTH,
    build_cases,
    gdn_layer,
    layers,
    make_inputs,
    reference,
    ssd_layer,
)

TOL = 1e-10


def run_case(name, plan, doc_lens, ref, rank, group, failures, seed=0):
    """Forward and backward of both layers on this rank against the reference; appends failure messages."""
    pos = torch.from_numpy(rank_token_positions(plan, doc_lens, rank)[0])
    meta = RecurrentMeta.from_plan(plan, doc_lens, rank)
    for kind, (data, params) in make_inputs(int(np.sum(doc_lens)), seed).items():
        layer, conv, recurrence = layers(doc_lens, meta, group)[kind]
        want_out, want_grads, grad_out = ref[kind]
        where = f"{name} {kind} rank {rank} (pieces {meta.num_pieces})"
        local = [t[pos].requires_grad_() for t in data]
        local_params = [t.requires_grad_() for t in params]
        calls.clear()
        out = layer(*local, *local_params, conv, recurrence)
        forward = list(calls)
        out.backward(grad_out[pos])
        check_collectives(where, kind, meta, forward, calls[len(forward):], failures)
        for p in local_params:
            dist.all_reduce(p.grad, group=group)
        checks = [("out", out, want_out[pos])]
        checks += [(f"d data{i}", t.grad, g[pos]) for i, (t, g) in enumerate(zip(local, want_grads))]
        checks += [(f"d param{i}", t.grad, g) for i, (t, g) in enumerate(zip(local_params, want_grads[len(data):]))]
        for what, got, want in checks:
            if want.numel() == 0:
                continue
            if got is None:
                failures.append(f"{where}: no gradient for {what}")
                continue
            err = (got - want).abs()
            if err.max().item() >= TOL:
                failures.append(f"{where}: {what} max |err| {err.max().item():.3g}, mean {err.mean().item():.3g}")


calls: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
"""(input splits, output splits, bytes per row) of every all-to-all the layers issued, in order."""


def _recording(collective):
    def record(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
        row_bytes = math.prod(input.shape[1:]) * input.element_size()
        calls.append((tuple(input_split_sizes), tuple(output_split_sizes), row_bytes))
        return collective(output, input, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes,
                          group=group, **kwargs)
    return record


def check_collectives(where, kind, meta, forward, backward, failures):
    """The conv inputs' all-to-all, then the maps', forward (each when it moves anything); their reverse."""
    if not meta.active:
        if forward or backward:
            failures.append(f"{where}: no document is cut, yet it issued {forward + backward}")
        return
    features = 2 * GDN["key_heads"] * GDN["dk"] + GDN["heads"] * GDN["dv"] if kind == "gdn" else \
        SSD["heads"] * SSD["p"] + 2 * SSD["groups"] * SSD["s"]
    if kind == "gdn":  # per head a K x K transition and a K x V state
        state_map = GDN["heads"] * GDN["dk"] * (GDN["dk"] + GDN["dv"])
    else:  # per head a scalar decay and a P x S state
        state_map = SSD["heads"] * (1 + SSD["p"] * SSD["s"])
    want = [(route.send_splits, route.recv_splits, row_bytes)
            for route, row_bytes in ((meta.conv_tails(WIDTH), 8 * features), (meta.maps, 8 * state_map))
            if route.active]
    if forward != want:
        failures.append(f"{where}: forward collectives {forward}, expected {want}")
    reverse = [(recv, send, row_bytes) for send, recv, row_bytes in reversed(want)]
    if backward != reverse:
        failures.append(f"{where}: backward collectives {backward}, expected {reverse}")


def check_low_precision(plan, doc_lens, ref, rank, failures):
    """CP in float32 and bf16: error against float64 at most twice one process's (plus a rounding floor)."""
    pos = torch.from_numpy(rank_token_positions(plan, doc_lens, rank)[0])
    meta = RecurrentMeta.from_plan(plan, doc_lens, rank)
    cu = np.concatenate([[0], np.cumsum(doc_lens)]).tolist()
    single = {"gdn": (gdn_layer, lambda x, w, b: causal_conv1d(x, w, b, cu),
                      lambda *a: chunk_gated_delta_rule(*a, cu, chunk_size=4)[0]),
              "ssd": (ssd_layer, lambda x, w, b: causal_conv1d(x, w, b, cu),
                      lambda x, dt, A, B, C, D: chunk_ssd(x, dt, A, B, C, cu, D_H=D, chunk_size=4)[0])}
    for dtype, floor in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for kind, (data, params) in make_inputs(int(np.sum(doc_lens)), 0).items():
            want = ref[kind][0][pos]
            data, params = [t.to(dtype) for t in data], [t.to(dtype) for t in params]
            layer, conv, recurrence = single[kind]
            one = layer(*data, *params, conv, recurrence)[pos].double()
            layer, conv, recurrence = layers(doc_lens, meta)[kind]
            got = layer(*(t[pos] for t in data), *params, conv, recurrence).double()
            if want.numel() == 0:
                continue
            cp_err, one_err = (got - want).abs().max().item(), (one - want).abs().max().item()
            if cp_err > 2 * one_err + floor:
                failures.append(f"{kind} {dtype} rank {rank}: CP max |err| {cp_err:.3g} against float64, one "
                                f"process {one_err:.3g}")


def stacked(doc_lens, meta=None, group=None, seed=0):
    """A GDN layer feeding an SSD layer through fixed projections: ``(loss inputs, output)``.

    Two recurrent layers in a row, four exchanges forward: their reverse collectives must come in the same
    order on every rank, also on ranks that hold only whole documents or nothing.
    """
    gen = torch.Generator().manual_seed(seed + 7)
    (gdn_data, gdn_params), (_, ssd_params) = make_inputs(int(np.sum(doc_lens)), seed).values()
    heads, groups, p, s = SSD.values()
    width_in = GDN["heads"] * GDN["dv"]
    to_ssd = torch.randn(width_in, heads * p + 2 * groups * s + heads, generator=gen, dtype=torch.float64)
    gdn, ssd = layers(doc_lens, meta, group)["gdn"], layers(doc_lens, meta, group)["ssd"]

    def run(*inputs):
        mixed, g, beta, w_gdn, w_ssd, b_ssd, A_log, dt_bias, D = inputs
        hidden = gdn[0](mixed, g, beta, w_gdn, *gdn[1:]).reshape(-1, width_in) @ to_ssd
        xbc, dt_raw = hidden[:, :-heads], hidden[:, -heads:]
        return ssd[0](xbc, dt_raw, w_ssd, b_ssd, A_log, dt_bias, D, *ssd[1:])

    return [*gdn_data, *gdn_params, *ssd_params], run


def check_stacked(plan, doc_lens, rank, group, failures):
    """Forward and backward of two stacked layers on this rank against the reference."""
    inputs, run = stacked(doc_lens)
    inputs = [t.requires_grad_() for t in inputs]
    want = run(*inputs)
    grad_out = torch.randn(want.shape, generator=torch.Generator().manual_seed(3), dtype=want.dtype)
    want_grads = torch.autograd.grad(want, inputs, grad_out)
    pos = torch.from_numpy(rank_token_positions(plan, doc_lens, rank)[0])
    local, run = stacked(doc_lens, RecurrentMeta.from_plan(plan, doc_lens, rank), group)
    local = [t[pos].requires_grad_() if i < 3 else t.requires_grad_() for i, t in enumerate(local)]
    got = run(*local)
    got.backward(grad_out[pos])
    for t in local[3:]:
        dist.all_reduce(t.grad, group=group)
    pairs = [(got, want[pos])] + [(t.grad, w[pos] if i < 3 else w) for i, (t, w) in enumerate(zip(local, want_grads))]
    errors = [(a - b).abs().max().item() if b.numel() else 0.0 for a, b in pairs]
    if max(errors) >= TOL:
        failures.append(f"stacked rank {rank}: max |err| of out and each gradient {errors}")


def subgroup_case(index):
    rng = np.random.default_rng(88 + index)
    doc_lens = rng.integers(3, 12, size=3)
    return f"subgroup{index}", random_plan(doc_lens, 2, rng, max_pieces=3, cut_prob=0.3), doc_lens


def _worker(rank, world_size, refs):
    dist.all_to_all_single = _recording(dist.all_to_all_single)
    failures = []
    for case, ref in zip(build_cases(world_size), refs):
        run_case(*case, ref, rank=rank, group=None, failures=failures)
    if world_size == 2:
        name, plan, doc_lens = build_cases(world_size)[3]  # one document over both ranks
        check_low_precision(plan, doc_lens, refs[3], rank, failures)
    for name, plan, doc_lens in build_cases(world_size):
        if name in ("random1", "empty-ranks"):
            check_stacked(plan, doc_lens, rank, None, failures)
    if world_size == 4:
        # two CP groups of 2 inside the world: the exchanges use the group they are given
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        name, plan, doc_lens = subgroup_case(rank // 2)
        run_case(name, plan, doc_lens, refs[-2 + rank // 2], rank % 2, groups[rank // 2], failures)
    return failures


@pytest.mark.parametrize("world_size", [2, 4])
def test_cp_recurrent_layers_match_reference_on_gloo(world_size):
    # the reference runs once, here; the ranks only compare with it
    cases = build_cases(world_size) + ([subgroup_case(0), subgroup_case(1)] if world_size == 4 else [])
    spawn(_worker, world_size, [reference(doc_lens) for _, _, doc_lens in cases])
