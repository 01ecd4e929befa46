"""The recurrent cost model (``flashcp.costmodel.recurrent``) against what a real CP run moves and computes.

On 2 and 4 gloo ranks, float32, each rank runs ``cp_causal_conv1d`` then ``cp_gated_delta_rule`` and
``cp_ssd`` forward and backward on random plans that cut documents (and one that cuts none), with
``dist.all_to_all_single`` wrapped to count the bytes it really moves between different ranks (its split sizes
times the bytes of a row) and the kernels wrapped to count the tokens (and GDN's value columns) they run. Each
rank's sent and received bytes must equal the cost model's for its rank, the sent bytes must be its contributed
maps' bytes times their destinations plus its needed inputs' (no padding row), and the all-ranks totals are
summed with one all-reduce after the layers. The ``CommStats`` handed to the layers records the same bytes.
"""

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from flashcp.costmodel.recurrent import RecurrentShape, recurrent_exchange, split_work
from flashcp.runtime.comm import CommStats
from flashcp.runtime.meta import rank_token_positions
from flashcp.runtime.recurrent import RecurrentMeta, backends, cp_causal_conv1d, cp_gated_delta_rule, cp_ssd
from tests.dist import spawn
from tests.emulate import random_plan
from tests.plans import whole_docs_case

HEADS, KEY_HEADS, DK, DV = 4, 2, 4, 3  # GDN
GROUPS, P, S = 2, 3, 5  # SSD (HEADS heads)
WIDTH = 4
SHAPES = {"gdn": RecurrentShape(kind="gdn", num_heads=HEADS, key_dim=DK, value_dim=DV, num_groups=KEY_HEADS,
                                conv_width=WIDTH, num_layers=1),
          "ssd": RecurrentShape(kind="ssd", num_heads=HEADS, key_dim=S, value_dim=P, num_groups=GROUPS,
                                conv_width=WIDTH, num_layers=1)}

moved: list[tuple[int, int]] = []
"""(bytes sent, bytes received) of every all-to-all issued, in order."""
run_tokens = {"tokens": 0, "value_tokens": 0}


def _count_all_to_all(collective):
    def wrapped(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
        me = dist.get_rank(group)
        row_bytes = math.prod(input.shape[1:]) * input.element_size()
        moved.append((row_bytes * sum(n for r, n in enumerate(input_split_sizes) if r != me),
                      row_bytes * sum(n for r, n in enumerate(output_split_sizes) if r != me)))
        return collective(output, input, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes,
                          group=group, **kwargs)
    return wrapped


def _count_kernel(kernel, value_arg):
    def wrapped(*args, **kwargs):
        values = args[value_arg]
        run_tokens["tokens"] += values.shape[0]
        run_tokens["value_tokens"] += values.shape[0] * values.shape[2]
        return kernel(*args, **kwargs)
    return wrapped


def cases(cp):
    rng = np.random.default_rng(360 + cp)
    out = []
    for i in range(6):
        doc_lens = rng.integers(1, 20, size=int(rng.integers(1, 6)))
        out.append((f"random{i}", random_plan(doc_lens, cp, rng, max_pieces=4, cut_prob=0.2), doc_lens))
    doc_lens = np.array([8 * cp + 3])  # one document over every rank
    out.append(("one-doc", random_plan(doc_lens, cp, rng, max_pieces=3, cut_prob=0.1), doc_lens))
    doc_lens, plan = whole_docs_case(9 * cp, cp, rng)
    out.append(("whole-docs", plan, doc_lens))
    return out


def layer(kind, num_tokens, meta, gen, stats=None):
    """One conv + recurrence of ``kind`` on this rank's tokens, forward and backward (float32)."""
    if kind == "gdn":
        features = 2 * KEY_HEADS * DK + HEADS * DV
    else:
        features = HEADS * P + 2 * GROUPS * S
    x = torch.randn(num_tokens, features, generator=gen).requires_grad_()
    weight = (torch.randn(features, WIDTH, generator=gen) * 0.5).requires_grad_()
    y = cp_causal_conv1d(x, weight, None, meta, backend="reference", stats=stats)
    if kind == "gdn":
        q, k, v = y.split([KEY_HEADS * DK, KEY_HEADS * DK, HEADS * DV], dim=1)
        g = -torch.rand(num_tokens, HEADS, generator=gen)
        beta = torch.sigmoid(torch.randn(num_tokens, HEADS, generator=gen))
        out = cp_gated_delta_rule(q.reshape(-1, KEY_HEADS, DK), k.reshape(-1, KEY_HEADS, DK),
                                  v.reshape(-1, HEADS, DV), g, beta, meta, chunk_size=4, backend="reference",
                                  stats=stats)
    else:
        xs, B, C = y.split([HEADS * P, GROUPS * S, GROUPS * S], dim=1)
        dt = torch.nn.functional.softplus(torch.randn(num_tokens, HEADS, generator=gen))
        A = -torch.exp(torch.randn(HEADS, generator=gen) * 0.5)
        out = cp_ssd(xs.reshape(-1, HEADS, P), dt, A, B.reshape(-1, GROUPS, S), C.reshape(-1, GROUPS, S), meta,
                     chunk_size=4, backend="reference", stats=stats)
    out.backward(torch.randn(out.shape, generator=gen))


def _by_definition(plan, rank, shape):
    """Bytes ``rank`` sends per pass, counted piece by piece: a map per contributed piece and other rank holding
    a later piece of its document, and each of its input tokens that another rank's piece starts within
    ``W - 1`` tokens after, once per such rank."""
    shards = list(zip(plan.shard_doc.tolist(), plan.shard_start.tolist(), plan.shard_len.tolist(),
                      plan.shard_rank.tolist()))
    maps = tokens = 0
    for doc, start, length, owner in shards:
        if owner != rank:
            continue
        maps += len({r for d, s, _, r in shards if d == doc and s > start and r != rank})
        for t in range(start, start + length):
            tokens += len({r for d, s, _, r in shards if d == doc and r != rank and t < s <= t + WIDTH - 1})
    return maps * shape.map_bytes + tokens * shape.conv_token_bytes


def _worker(rank, cp):
    dist.all_to_all_single = _count_all_to_all(dist.all_to_all_single)
    backends.gated_delta = _count_kernel(backends.gated_delta, 2)
    backends.ssd = _count_kernel(backends.ssd, 0)
    failures = []
    for name, plan, doc_lens in cases(cp):
        meta = RecurrentMeta.from_plan(plan, doc_lens, rank)
        num_tokens = rank_token_positions(plan, doc_lens, rank)[0].shape[0]
        arrays = (plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, cp)
        work = split_work(*arrays)
        for kind, shape in SHAPES.items():
            moved.clear()
            run_tokens.update(tokens=0, value_tokens=0)
            stats = CommStats()
            layer(kind, num_tokens, meta, torch.Generator().manual_seed(7), stats)
            exchange = recurrent_exchange(shape, *arrays)
            where = f"{name} {kind} rank {rank}"
            # the forward's all-to-alls, then the backward's: the same calls the other way
            forward, backward = moved[:len(moved) // 2], moved[len(moved) // 2:]
            got = tuple(sum(c) for c in zip(*forward)) or (0, 0)
            got_back = tuple(sum(c) for c in zip(*backward)) or (0, 0)
            want = int(exchange.sent_bytes[rank]), int(exchange.received_bytes[rank])
            if len(forward) != len(backward) or got != want or got_back != want[::-1]:
                failures.append(f"{where}: forward moved {got} (sent, received), backward {got_back}, the cost "
                                f"model says {want}")
            recorded = [(stats.total("sent_bytes", direction), stats.total("recv_bytes", direction))
                         for direction in ("forward", "backward")]
            tensors = sorted({(r.direction, r.tensor) for r in stats.records})
            if recorded != [got, got_back] or len(stats.records) != len(moved) or (moved and tensors != [
                    ("backward", "dconv"), ("backward", "dstate"), ("forward", "conv"), ("forward", "state")]):
                failures.append(f"{where}: CommStats recorded {recorded} in {tensors}, the collectives moved "
                                f"{[got, got_back]}")
            if want[0] != _by_definition(plan, rank, shape):
                failures.append(f"{where}: the cost model sends {want[0]} bytes, counted piece by piece "
                                f"{_by_definition(plan, rank, shape)}")
            totals = torch.tensor(got, dtype=torch.int64)
            dist.all_reduce(totals)
            if totals.tolist() != [exchange.total_bytes] * 2:
                failures.append(f"{where}: all ranks moved {totals.tolist()} forward, the cost model "
                                f"{exchange.total_bytes}")
            # the forward's kernel runs: each token once, plus the rerun pieces (and GDN's K value columns)
            extra = run_tokens["tokens"] - num_tokens
            if extra != work.rerun_tokens[rank]:
                failures.append(f"{where}: ran {extra} extra tokens, cost model {work.rerun_tokens[rank]}")
            value_value = DV if kind == "gdn" else P
            extra_work = (run_tokens["value_tokens"] - num_tokens * value_value) / value_value
            if not np.isclose(extra_work, work.extra_tokens(shape)[rank]):
                failures.append(f"{where}: extra work {extra_work} tokens, cost model {work.extra_tokens(shape)[rank]}")
            if name == "whole-docs" and moved:
                failures.append(f"{where}: no document is cut, yet it issued {len(moved)} all-to-alls")
    return failures


@pytest.mark.parametrize("cp", [2, 4])
def test_cost_model_equals_what_the_runtime_moves_and_runs(cp):
    assert any(recurrent_exchange(SHAPES["gdn"], p.shard_doc, p.shard_start, p.shard_len, p.shard_rank, cp).total_bytes
               for _, p, _ in cases(cp))  # the cases do cut documents
    spawn(_worker, cp, start_method="fork")  # the ranks skip re-importing torch
