"""flashcp2 at frontier scale: the ceiling, the bounded candidates, the cliff sequence, the topology."""

import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flashcp.costmodel.comm import exchange_volumes
from flashcp.costmodel.objective import cached_model, plan_step_seconds
from flashcp.costmodel.profile import load_profile
from flashcp.planner.params import parse_topology
from flashcp.planner.planning import plan_sequence
from flashcp.planner.strategies import flashcp2 as _search
from flashcp.planner.strategies.flashcp import flashcp_bounded
from flashcp.planner.strategies.flashcp_plus import flashcp_plus_bounded
from tests.naive import (
    naive_flashcp,
    naive_flashcp2,
    naive_flashcp_plus,
    naive_metrics,
)
from tests.plans import as_tuples, examples, packed, sequences

MODEL = cached_model(None, 32, 32, 128, 1)


# --- bounded candidates


@examples(40)
@given(case=sequences(max_docs=12, max_len=4000), target=st.sampled_from([1.0, 1.01, 1.05]),
       bound=st.sampled_from([0, 2, 8]))
def test_bounded_kernels_equal_references(case, target, bound):
    lens, cp = case
    arr = np.asarray(lens, np.int64)
    got = flashcp_plus_bounded(arr, cp, target, bound)
    assert list(zip(*(a.tolist() for a in got))) == naive_flashcp_plus(lens, cp, target, bound)
    got = flashcp_bounded(arr, cp, target, np.inf, bound)
    expected = naive_flashcp(lens, cp, target, bound)
    assert list(zip(*(a.tolist() for a in got))) == (expected or [])
    if expected is not None:  # within the bound it is Algorithm 1 itself
        assert expected == as_tuples(plan_sequence("flashcp", lens, cp, target_imbalance=max(target, 1.0)))


# --- placing ranks on nodes


@examples(15)
@given(case=sequences(max_docs=10, max_len=3000, max_cp=6), per_node=st.sampled_from([1, 2, 3]))
def test_flashcp2_with_topology_equals_reference(case, per_node):
    lens, cp = case
    if cp <= per_node or cp % per_node:
        cp = 2 * per_node if sum(lens) >= 2 * per_node else 1
    topology = f"{cp // per_node}x{per_node}" if cp > 1 else None
    got = plan_sequence("flashcp2", lens, cp, topology=topology)
    assert as_tuples(got) == naive_flashcp2(lens, cp, gpus_per_node=per_node if cp > 1 else 0)


def test_topology_is_checked():
    assert parse_topology("2x8") == (2, 8) and parse_topology("4X8") == (4, 8)
    for bad in ("2", "x8", "2x0", "ax8", "2x8x1"):
        with pytest.raises(ValueError, match="NODESxGPUS"):
            parse_topology(bad)
    with pytest.raises(ValueError, match="holds 16 ranks, not the 8"):
        plan_sequence("flashcp2", [9000, 7000], 8, topology="2x8")
    with pytest.raises(ValueError, match="takes no topology"):
        plan_sequence("flashcp+", [9000, 7000], 2, topology="2x1")


def test_topology_cuts_inter_node_receive_on_2x8():
    """Planned for 2 x 8, flashcp2's busiest inter-node receive drops against the plan made without the
    layout, and its step time priced with the layout is no worse."""
    model = cached_model(None, 32, 32, 128, 1, False, 8)
    far, steps = [], []
    for lens in packed("prolong", 8, 131072, seed=2):
        plans = [plan_sequence("flashcp2", lens, 16), plan_sequence("flashcp2", lens, 16, topology="2x8")]
        far.append([exchange_volumes(p.shard_doc, p.shard_start, p.shard_len, p.shard_rank, 16, 8)
                    .received_far.max() for p in plans])
        steps.append([plan_step_seconds(p, model) for p in plans])
    far, steps = np.array(far), np.array(steps)
    assert far[:, 1].mean() < far[:, 0].mean(), far
    assert steps[:, 1].mean() <= steps[:, 0].mean(), steps


# --- the ceiling


def _a_faster_peers_plan(plan, lens, cp) -> bool:
    """Whether ``plan`` is the default plan of one of flashcp2's peers (flashcp+, magi, flashcp, llama3, ptrr):
    flashcp2 ends by taking the fastest of those under its objective, past the imbalance ceiling if need be."""
    shards = as_tuples(plan)
    return any(shards == as_tuples(plan_sequence(peer, lens, cp)) for peer in _search.PEERS)


@pytest.mark.parametrize("dist", ["wlb", "prolong"])
def test_flashcp2_never_slower_than_flashcp_plus_or_algorithm1(dist):
    """The default ceiling (1.05) is never slower under the objective than flashcp+ (1.01) or Algorithm 1
    (1.05) on any sequence, and on average not slower than flashcp2 capped at 1.01 (the old default): the
    local search from another start may end a little slower on a few sequences."""
    mine, capped = [], []
    for context_len, cps, count in ((131072, (4, 8, 16, 32), 10), (524288, (64,), 4)):
        for lens in packed(dist, count, context_len, seed=5):
            for cp in cps:
                ours = plan_sequence("flashcp2", lens, cp)
                ours.validate(lens)
                mine.append(plan_step_seconds(ours, MODEL))
                for other in (plan_sequence("flashcp+", lens, cp), plan_sequence("flashcp", lens, cp)):
                    assert mine[-1] <= plan_step_seconds(other, MODEL), (dist, context_len, cp)
                capped.append(plan_step_seconds(plan_sequence("flashcp2", lens, cp, target_imbalance=1.01), MODEL))
                assert ours.metrics().imbalance <= 1.05 + 1e-12 or _a_faster_peers_plan(ours, lens, cp)
    mine, capped = np.array(mine), np.array(capped)
    assert mine.mean() <= capped.mean()
    assert (mine > capped).sum() <= 2, f"{(mine > capped).sum()} of {mine.size} slower than capped at 1.01"


def test_cliff_sequence():
    """wlb 512K cp 64, sequence 58 of the bench's seed 0: capped at 1.01 (the old default) it took flashcp+'s
    plan of 10,431 shards receiving 80.8% of the K/V (planning 1.2 s); now it plans within the shard bound
    and receives at most twice what the plan at 1.015 receives."""
    lens = packed("wlb", 59, 524288)[58]
    cp = 64
    plan_sequence("flashcp2", lens, cp)  # compiled and warm
    began = time.process_time()
    plan = plan_sequence("flashcp2", lens, cp)
    seconds = time.process_time() - began
    plan.validate(lens)
    full = (cp - 1) * 524288 / cp
    received = plan.metrics().a2a_comm_tokens / full
    at_1015 = plan_sequence("flashcp2", lens, cp, target_imbalance=1.015).metrics().a2a_comm_tokens / full
    old = plan_sequence("flashcp+", lens, cp)  # what the capped default returned
    assert old.num_shards > 10_000 and old.metrics().a2a_comm_tokens / full > 0.8
    assert plan.num_shards <= lens.size + _search.MAX_EXTRA_SHARDS * cp
    assert received <= 2 * at_1015 and received < 0.2, (received, at_1015)
    assert plan_step_seconds(plan, MODEL) < plan_step_seconds(old, MODEL)
    assert seconds < 0.25, f"planning took {seconds:.3f} s of CPU (target 25 ms; this bound catches cliffs)"


@examples(30)
@given(case=sequences(max_docs=16, max_len=20000))
def test_flashcp2_within_the_ceiling_and_the_shard_bound(case):
    lens, cp = case
    for target in (1.01, 1.05, 1.2):
        plan = plan_sequence("flashcp2", lens, cp, target_imbalance=target)
        plan.validate(lens)
        if _a_faster_peers_plan(plan, lens, cp):  # the one way over the ceiling (flashcp2's last step)
            continue
        base = naive_metrics(naive_flashcp_plus(lens, cp, min(target, 1.01), _search.MAX_ZIGZAG), cp)[0]
        assert plan.metrics().imbalance <= max(target, base) + 1e-12
        assert plan.num_shards <= max(len(lens) + _search.MAX_EXTRA_SHARDS * cp,
                                      len(naive_flashcp_plus(lens, cp, min(target, 1.01), _search.MAX_ZIGZAG)))


def test_plan_json_and_show_report_intra_and_inter_node_receive(tmp_path):
    import json

    from click.testing import CliRunner

    from flashcp.cli import cli

    def run(*args):
        return CliRunner().invoke(cli, [str(a) for a in args])

    root = tmp_path / "d"
    synth = run("synth", root, "--dist", "prolong", "--num-seqs", 3, "--context-len", 16384, "--no-tokens")
    assert synth.exit_code == 0
    result = run("plan", root, "--cp", 4, "--topology", "2x2", "--name", "nodes")
    assert result.exit_code == 0, result.output
    meta = json.loads((root / "plans" / "nodes" / "plan.json").read_text())
    assert meta["params"]["topology"] == "2x2"
    summary = meta["summary"]["topology"]
    assert summary["gpus_per_node"] == 2 and summary["a2a_inter_node_tokens_mean"] >= 0
    assert "from other nodes" in result.output
    shown = run("show", root, "--plan", "nodes", "--seq", 1, "--json")
    assert shown.exit_code == 0, shown.output
    got = json.loads(shown.stdout)
    assert got["gpus_per_node"] == 2 and [r["node"] for r in got["ranks"]] == [0, 0, 1, 1]
    assert got["a2a_inter_node_tokens"] == max(r["received_inter_node"] for r in got["ranks"])
    assert run("verify", root).exit_code == 0
    result = run("plan", root, "--cp", 4, "--topology", "3x2", "--name", "bad")
    assert result.exit_code == 1 and "holds 6 ranks, not the 4" in result.output
    plain = json.loads((root / "plans" / "nodes" / "plan.json").read_text())
    assert run("plan", root, "--cp", 4).exit_code == 0
    assert "topology" not in json.loads((root / "plans" / "cp4-flashcp2" / "plan.json").read_text())["summary"]
    assert plain == meta


def test_profile_inter_node_fields(tmp_path):
    import json

    from flashcp.bench.calibrate import save_profile
    from flashcp.errors import FlashcpError

    profile = load_profile()
    assert profile.inter_node_gbps == 50.0 and profile.gpus_per_node == 0
    obj = profile.to_json()
    del obj["inter_node_gbps"], obj["gpus_per_node"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(obj))
    old = load_profile(path)  # a profile without the fields: one node, the inter-node link as NVLink
    assert old.inter_node_gbps == old.link_gbps and old.gpus_per_node == 0
    obj["gpus_per_node"] = {"value": 8, "source": "a DGX node"}
    path.write_text(json.dumps(obj))
    assert load_profile(path).gpus_per_node == 8
    save_profile(load_profile(path), tmp_path / "again.json")
    assert load_profile(tmp_path / "again.json").gpus_per_node == 8
    obj["gpus_per_node"] = {"value": 7.5, "source": "half a GPU"}
    path.write_text(json.dumps(obj))
    with pytest.raises(FlashcpError, match="gpus_per_node must be a whole number"):
        load_profile(path)
