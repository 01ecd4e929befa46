"""cp_attention on 2, 3 and 4 gloo ranks against a single-process dense reference (float64, 1e-10).

Every rank builds the same cases from the same seed, runs forward and backward for every comm mode (the
collectives and the point-to-point ring), and compares its slice of out / dq / dk / dv with the dense
document-masked reference on the whole sequence. It also checks that the K/V tokens each collective or ring
step actually moved equal the plan's comm numbers: for the ring, (N-1)/N of the sequence's K/V per rank.
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from flashcp.costmodel.comm import allgather_contributions, exact_need_received, kv_bytes_per_token, ring_comm_tokens
from flashcp.costmodel.workload import token_quotas
from flashcp.runtime import CommStats, CPAttnMeta, cp_attention
from flashcp.runtime.meta import rank_token_positions
from tests.dist import spawn
from tests.emulate import random_plan
from tests.naive import naive_document_attention
from tests.plans import llama3_like_plan
from tests.runtime.attention_cases import build_cases, max_abs

TOL = 1e-10
COMMS = ("allgather", "a2a", "full", "ring", "auto")
def run_case(name, plan, doc_lens, num_heads, num_kv_heads, rank, group, failures, seed=0):
    """Forward + backward of every comm mode on this rank; appends failure messages."""
    cp = plan.cp
    context_len = int(np.sum(doc_lens))
    gen = torch.Generator().manual_seed(seed)
    q, k, v, grad_out = (torch.randn(context_len, h, 8, dtype=torch.float64, generator=gen)
                         for h in (num_heads, num_kv_heads, num_kv_heads, num_heads))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = naive_document_attention(q, k, v, doc_lens)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    pos = torch.from_numpy(rank_token_positions(plan, doc_lens, rank)[0])
    meta = CPAttnMeta.from_plan(plan, doc_lens, rank)
    args = (plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, cp)
    stored = plan.metrics()
    for comm in COMMS:
        where = f"{name} H={num_heads} K={num_kv_heads} comm={comm}"
        q_loc, k_loc, v_loc = (t.detach()[pos].requires_grad_() for t in (q, k, v))
        stats = CommStats()
        out = cp_attention(q_loc, k_loc, v_loc, meta, group=group, comm=comm, stats=stats)
        out.backward(grad_out[pos])
        errors = [max_abs(out, ref[pos])] + [max_abs(t.grad, g[pos]) for t, g in zip((q_loc, k_loc, v_loc),
                                                                                    ref_grads)]
        if max(errors) >= TOL:
            failures.append(f"{where}: max |err| of out, dq, dk, dv = {errors}")
        mode = meta.resolve_comm(comm, k_loc.element_size())  # what cp_attention picked for float64 K/V
        if mode == "ring":
            check_ring_comm(where, stats, meta, context_len,
                            ring_comm_tokens(plan.shard_len, plan.shard_rank, cp),
                            kv_bytes_per_token(num_kv_heads, 8, 8), failures)
        else:
            check_comm(where, mode, stats, meta, stored, allgather_contributions(*args)[rank],
                       exact_need_received(*args)[rank], token_quotas(context_len, cp).max(),
                       kv_bytes_per_token(num_kv_heads, 8, 8), failures)


def check_comm(where, mode, stats, meta, stored, contribution, received, max_quota, token_bytes, failures):
    """The rows each collective moved equal the plan's numbers (nothing at all when the mode is inactive)."""
    cp = meta.cp
    records = {r.direction: r for r in stats.records}
    if not meta.exchanges[mode].active:
        if stats.records:
            failures.append(f"{where}: an inactive exchange issued {len(stats.records)} collectives")
        return
    fwd, bwd = records.get("forward"), records.get("backward")
    if fwd is None or bwd is None or len(stats.records) != 2:
        failures.append(f"{where}: expected one forward and one backward collective, got {stats.records}")
        return
    if mode == "allgather":
        wire = (cp - 1) * stored.ag_comm_tokens
        want = {"input_rows": stored.ag_comm_tokens, "payload_rows": contribution, "sent_tokens": wire,
                "recv_tokens": wire}
    elif mode == "a2a":
        want = {"recv_tokens": received, "sent_tokens": meta.exchanges["a2a"].wire_send_tokens}
    else:
        want = {"input_rows": max_quota, "payload_rows": meta.num_tokens, "recv_tokens": (cp - 1) * max_quota}
    got = {key: getattr(fwd, key) for key in want}
    if got != want:
        failures.append(f"{where}: forward collective moved {got}, the plan says {want}")
    if (bwd.sent_tokens, bwd.recv_tokens) != (fwd.recv_tokens, fwd.sent_tokens):
        failures.append(f"{where}: backward moved {bwd.sent_tokens} out / {bwd.recv_tokens} in, forward "
                        f"{fwd.sent_tokens} out / {fwd.recv_tokens} in")
    for record in (fwd, bwd):
        bytes_moved = (record.sent_bytes, record.recv_bytes)
        if bytes_moved != (record.sent_tokens * token_bytes, record.recv_tokens * token_bytes):
            failures.append(f"{where}: {record.direction} bytes {bytes_moved} are not tokens x {token_bytes}")


def check_ring_comm(where, stats, meta, context_len, sent_recv, token_bytes, failures):
    """Each ring step moved one whole block; per pass every rank received all blocks but its own."""
    cp, rank, ring = meta.cp, meta.rank, meta.ring
    kinds = (("forward", "kv"), ("backward", "kv"), ("backward", "dkv"))
    records = {kind: [r for r in stats.records if (r.direction, r.tensor) == kind] for kind in kinds}
    if len(stats.records) != 3 * (cp - 1) or any(len(r) != cp - 1 for r in records.values()):
        got = [(r.direction, r.tensor) for r in stats.records]
        failures.append(f"{where}: expected {cp - 1} transfers of each: K/V fwd, K/V and dK/dV bwd: {got}")
        return
    sent, received = (int(x[rank]) for x in sent_recv)
    for kind, group in records.items():
        # K/V: step s brings the block of rank r - s - 1; dK/dV: the buffer of the block hosted one step later
        lag = 2 if kind[1] == "dkv" else 1
        expect_in = [ring.block_rows[(rank - s - lag) % cp] for s in range(cp - 1)]
        got_in = [r.recv_tokens for r in group]
        if got_in != expect_in:
            failures.append(f"{where}: {kind} steps received {got_in} tokens, the blocks are {expect_in}")
        if any((r.sent_bytes, r.recv_bytes) != (r.sent_tokens * token_bytes, r.recv_tokens * token_bytes)
               for r in group):
            failures.append(f"{where}: {kind} bytes are not tokens x {token_bytes}")
    forward = records[("forward", "kv")]
    moved = (sum(r.sent_tokens for r in forward), sum(r.recv_tokens for r in forward))
    if moved != (sent, received) or moved != (ring.wire_send_tokens, ring.wire_recv_tokens):
        failures.append(f"{where}: forward moved {moved} tokens out/in, the cost model says "
                        f"{(sent, received)}")
    fraction = (cp - 1) * context_len // cp * token_bytes  # (N-1)/N of the whole sequence's K/V
    got_bytes = sum(r.recv_bytes for r in forward)
    if context_len % cp == 0 and got_bytes != fraction:
        failures.append(f"{where}: forward received {got_bytes} bytes, not (N-1)/N of the K/V ({fraction})")
    dkv_sent = sum(r.sent_tokens for r in records[("backward", "dkv")])
    if dkv_sent != received:
        failures.append(f"{where}: dK/dV sent {dkv_sent} tokens, but K/V received {received}")


def _worker(rank, world_size):
    failures = []
    for case in build_cases(world_size):
        run_case(*case, rank=rank, group=None, failures=failures)
    if world_size == 2:
        # a meta for the other rank is refused before any collective is issued
        doc_lens = np.array([6, 3])
        plan = llama3_like_plan(doc_lens, 2)
        meta = CPAttnMeta.from_plan(plan, doc_lens, 1 - rank)
        x = torch.zeros(meta.num_tokens, 2, 4, dtype=torch.float64)
        try:
            cp_attention(x, x, x, meta, comm="a2a")
            failures.append("a meta for another rank was accepted")
        except ValueError as e:
            if "the meta is for rank" not in str(e):
                failures.append(f"unexpected error for a meta of another rank: {e}")
    if world_size == 4:
        # two independent CP groups of 2 inside the world: collectives must use the group they are given
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        rng = np.random.default_rng(77 + rank // 2)
        doc_lens = rng.integers(1, 10, size=4)
        plan = random_plan(doc_lens, 2, rng, max_pieces=3)
        run_case(f"subgroup{rank // 2}", plan, doc_lens, 4, 2, rank % 2, groups[rank // 2], failures)
    return failures


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_cp_attention_matches_dense_reference_on_gloo(world_size):
    spawn(_worker, world_size)
