"""The latency projection (flashcp.costmodel.projection): cost-model properties, the runtime's own volumes and
auto rule, the objective's step time over shapes, dtypes and token slack."""


import numpy as np
import pytest

from flashcp.costmodel.comm import exact_need_received, exact_need_sent
from flashcp.costmodel.profile import load_profile
from flashcp.costmodel.projection import comm_volumes, local_only_mask, project_step, resolve_comm, shard_seconds
from flashcp.costmodel.shape import AttentionShape
from flashcp.costmodel.workload import rank_tokens, workload
from flashcp.planner.plan import SequencePlan
from flashcp.runtime.meta import build_rank_metas
from tests.emulate import random_plan
from tests.naive import naive_exact_need_sent
from tests.plans import llama3_like_plan, perdoc_like_plan, whole_docs_case

SHAPE = AttentionShape(num_heads=32, num_kv_heads=32, head_dim=128)


# ---------------------------------------------------------------- projection properties


def test_whole_documents_need_no_communication(profile):
    doc_lens, plan = whole_docs_case(4096, 4, np.random.default_rng(0))
    for comm in ("allgather", "a2a", "auto"):
        step = project_step(plan, SHAPE, profile, comm, overlap=False)
        assert step.comm_seconds == 0 and step.comm == 0 and step.comm_bytes == 0, comm
    full = project_step(plan, SHAPE, profile, "full", overlap=False)
    assert full.comm_seconds > 0 and full.total > project_step(plan, SHAPE, profile, "auto", False).total


def test_attention_time_is_monotone_in_flops(profile):
    """More work never takes less time: in length at a fixed prefix, in the prefix at a fixed length, and
    across whole-tile shards of any shape ordered by FLOPs."""
    lengths = np.arange(1, 40000, 37)
    for start in (0, 100, 5000):
        for backward in (False, True):
            seconds = shard_seconds(np.full(lengths.size, start), lengths, SHAPE, profile, backward)
            assert (np.diff(seconds) >= 0).all(), f"decreases in length at start {start}"
    starts = np.arange(0, 100000, 313)
    for length in (1, 64, 200, 4096):
        seconds = shard_seconds(starts, np.full(starts.size, length), SHAPE, profile, backward=True)
        assert (np.diff(seconds) > 0).all(), f"not increasing in the prefix at length {length}"
    rng = np.random.default_rng(0)
    starts, lengths = rng.integers(0, 100000, 500), profile.query_tile * rng.integers(1, 200, 500)
    order = np.argsort(workload(starts, lengths))
    seconds = shard_seconds(starts[order], lengths[order], SHAPE, profile)
    assert (np.diff(seconds) >= 0).all()
    tiny = shard_seconds([0, 0], [1, profile.query_tile], SHAPE, profile)
    assert tiny[0] == tiny[1] > 0, "a shard shorter than a tile pays for the whole tile"


def test_balanced_plan_beats_imbalanced_one(profile):
    doc_lens = np.array([1000] * 30 + [34000])  # a long document at the end lands on the last chunks
    llama3 = llama3_like_plan(doc_lens, 4)
    balanced = perdoc_like_plan(doc_lens, 4)
    assert llama3.metrics().imbalance > 1.5 > 1.01 > balanced.metrics().imbalance
    step = project_step(llama3, SHAPE, profile, "full", False)
    other = project_step(balanced, SHAPE, profile, "full", False)
    assert step.attn_fwd + step.attn_bwd > other.attn_fwd + other.attn_bwd


def test_overlap_never_slower_and_breakdown_adds_up(profile):
    rng = np.random.default_rng(3)
    for _ in range(20):
        doc_lens = rng.integers(1, 3000, size=int(rng.integers(1, 12)))
        plan = random_plan(doc_lens, 4, rng, max_pieces=4, cut_prob=0.001)
        for comm in ("full", "allgather", "a2a", "auto"):
            plain = project_step(plan, SHAPE, profile, comm, overlap=False)
            hidden = project_step(plan, SHAPE, profile, comm, overlap=True)
            assert hidden.total <= plain.total + 1e-12
            for step in (plain, hidden):
                parts = step.attn_fwd + step.attn_bwd + step.comm + step.other
                assert parts == pytest.approx(step.total, rel=1e-9)


def random_plans(seed: int, draws: int, *, max_len: int, max_docs: int, max_pieces: int, cut_prob: float):
    """``(doc_lens, cp, random_plan)`` of ``draws`` random sequences (below ``max_docs`` documents shorter than
    ``max_len``, cp 1 to 4), skipping the draws with fewer tokens than ranks."""
    rng = np.random.default_rng(seed)
    for _ in range(draws):
        doc_lens = rng.integers(1, max_len, size=int(rng.integers(1, max_docs)))
        cp = int(rng.integers(1, 5))
        if doc_lens.sum() >= cp:
            yield doc_lens, cp, random_plan(doc_lens, cp, rng, max_pieces=max_pieces, cut_prob=cut_prob)


def test_projection_matches_the_runtime_meta():
    """Local-only shards, the auto comm choice and a2a send volumes agree with CPAttnMeta's."""
    for doc_lens, _, plan in random_plans(7, 60, max_len=30, max_docs=8, max_pieces=5, cut_prob=0.2):
        metas = build_rank_metas(plan, doc_lens)
        mask = local_only_mask(plan)
        volumes = comm_volumes(plan)
        assert resolve_comm("auto", volumes) == metas[0].auto_comm
        for kv_bytes in (1, 2, 4, 8):  # one auto rule for every K/V dtype, runtime and projection alike
            picked = {meta.auto_comm_for(kv_bytes) for meta in metas}
            assert picked == {resolve_comm("auto", volumes, kv_bytes)}
        for meta in metas:
            assert (mask[plan.rank_slice(meta.rank)] == meta.shard_local_only.numpy()).all()
            assert volumes["a2a"]["send"][meta.rank] == meta.exchanges["a2a"].wire_send_tokens
            assert volumes["a2a"]["recv"][meta.rank] == meta.exchanges["a2a"].wire_recv_tokens


def test_exact_need_sent_equals_reference():
    for _, cp, plan in random_plans(11, 40, max_len=20, max_docs=6, max_pieces=4, cut_prob=0.3):
        args = (plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, cp)
        shards = list(zip(*(a.tolist() for a in args[:4])))
        sent = exact_need_sent(*args)
        assert sent.tolist() == naive_exact_need_sent(shards, cp)
        assert sent.sum() == exact_need_received(*args).sum()


def test_unknown_comm_is_refused(profile):
    plan = SequencePlan.from_arrays([0], [0], [8], [0], 1)
    with pytest.raises(ValueError, match="unknown comm mode"):
        project_step(plan, SHAPE, profile, "carrier-pigeon", False)


def test_ring_projection(profile):
    from flashcp.planner.strategies.baselines import ring_plan

    doc_lens = np.array([32768])  # one causal document: contiguous chunks are imbalanced, zigzag is not
    contiguous = project_step(ring_plan(doc_lens, 4), SHAPE, profile, "ring", overlap=True)
    zigzag = project_step(perdoc_like_plan(doc_lens, 4), SHAPE, profile, "ring", overlap=True)
    assert zigzag.total < contiguous.total
    for step in (contiguous, zigzag):
        assert step.comm_mode == "ring" and step.comm_seconds > 0 and step.comm_bytes > 0
        assert step.attn_fwd + step.attn_bwd + step.comm + step.other == pytest.approx(step.total, rel=1e-9)


def test_dense_kernels_pay_for_the_whole_rectangle(profile):
    from dataclasses import replace

    dense = replace(profile, causal_skip=False, query_tile=1)
    length = profile.lengths[2]
    (seconds,) = shard_seconds([0], [length], SHAPE, dense)
    flops = 4.0 * length * length * SHAPE.num_heads * SHAPE.head_dim
    assert seconds == pytest.approx(flops / (profile.forward_tflops[2] * 1e12))
    lengths = np.arange(1, 20000, 61)
    for start in (0, 3000):
        times = shard_seconds(np.full(lengths.size, start), lengths, SHAPE, dense, backward=True)
        assert (np.diff(times) > 0).all()


def test_backward_reduce_scatter_carries_float32(profile):
    """dK/dV go back in float32 over the all-gather's reduce-scatter (twice bf16's bytes), in bf16 over a2a;
    ``auto`` compares the two by bytes, forward plus backward, like the runtime. An a2a rank never moves more
    than ``(cp - 1) * slot`` tokens (it receives only contributed shards and sends each to at most cp - 1
    ranks), so with bf16 ``auto`` now takes a2a whenever anything moves."""
    rng = np.random.default_rng(11)
    for _ in range(40):
        doc_lens = rng.integers(1, 4000, size=int(rng.integers(2, 10)))
        cp = int(rng.integers(2, 6))
        plan = random_plan(doc_lens, cp, rng, max_pieces=4, cut_prob=0.001)
        volumes = comm_volumes(plan)
        link, latency = profile.link_gbps * 1e9, profile.collective_latency_us * 1e-6
        for comm in ("allgather", "full", "a2a"):
            vol = volumes[comm]
            tokens = int(vol["wire"].max()) if comm != "a2a" else int(np.maximum(vol["send"], vol["recv"]).max())
            wire = int(vol["wire"].max()) if comm != "a2a" else int(vol["send"].max())
            step = project_step(plan, SHAPE, profile, comm, overlap=False)
            grad_row = SHAPE.kv_row_bytes * (2 if comm != "a2a" else 1)
            expected = 0.0 if tokens == 0 else tokens * (SHAPE.kv_row_bytes + grad_row) / link + 2 * latency
            assert step.comm_seconds == pytest.approx(expected, rel=1e-12), comm
            assert step.comm_bytes == wire * (SHAPE.kv_row_bytes + grad_row), comm
        busiest = int(np.maximum(volumes["a2a"]["send"], volumes["a2a"]["recv"]).max())
        slot = int(volumes["allgather"]["send"].max())
        expected_mode = "a2a" if busiest * (2 + 2) < (cp - 1) * slot * (2 + 4) else "allgather"
        assert resolve_comm("auto", volumes) == expected_mode
        assert build_rank_metas(plan, doc_lens)[0].auto_comm == expected_mode
        assert expected_mode == ("a2a" if slot > 0 else "allgather")
        # float32 K/V: the reduce-scatter moves no more than the forward
        wide = AttentionShape(num_heads=32, num_kv_heads=32, head_dim=128, dtype_bytes=4)
        step = project_step(plan, wide, profile, "allgather", overlap=False)
        assert step.comm_bytes == 2 * int(volumes["allgather"]["wire"].max()) * wide.kv_row_bytes


def test_objective_equals_projection_over_shapes_dtypes_and_token_slack():
    """The planner's Numba step time and the bench's projection are one model: equal for every shape, element
    size, layer count and topology, with and without the per-token layers, on plans with token slack too."""
    from flashcp.costmodel.objective import model_vector, step_seconds
    from flashcp.costmodel.shape import AttentionShape
    from flashcp.planner import plan_sequence

    profile = load_profile()
    rng = np.random.default_rng(11)
    shapes = [AttentionShape(num_heads=32, num_kv_heads=32, head_dim=128),
              AttentionShape(num_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=4, layers=3),
              AttentionShape(num_heads=16, num_kv_heads=2, head_dim=64, dtype_bytes=1, hidden_mult=3.5),
              AttentionShape(num_heads=8, num_kv_heads=8, head_dim=256, dtype_bytes=8, layers=2)]
    unequal = 0
    for _ in range(8):
        lens = rng.integers(1, 20000, rng.integers(2, 25))
        cp = int(rng.choice([2, 4, 8]))
        plans = [plan_sequence(name, lens, cp) for name in ("flashcp", "llama3", "perdoc")]
        plans.append(plan_sequence("flashcp2", lens, cp, token_slack=0.1))
        ranks = np.sort(rng.integers(0, cp, lens.size))  # whole documents, any tokens per rank
        plans.append(SequencePlan.from_arrays(np.arange(lens.size), np.zeros(lens.size), lens, ranks, cp=cp))
        unequal += len(set(rank_tokens(plans[-1].shard_len, plans[-1].shard_rank, cp).tolist())) > 2
        for shape in shapes:
            for with_tokens in (False, True):
                for per_node in (0, 2):
                    model = model_vector(profile, shape, with_tokens=with_tokens, gpus_per_node=per_node)
                    for plan in plans:
                        expected = project_step(plan, shape, profile, "auto", True, gpus_per_node=per_node,
                                                token_layers=with_tokens).total * shape.layers
                        got = step_seconds(plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank,
                                           cp, model)
                        assert got == pytest.approx(expected, rel=1e-12)
    assert unequal > 0, "no plan held unequal tokens: the per-token layers were never tested apart"
