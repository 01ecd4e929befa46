"""flashcp2 planned for a model's layer kinds is never slower, under the bench's projection for that model,
than the default plans of flashcp+, magi, flashcp, llama3 and ptrr (one node and 2 nodes x 8)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flashcp.costmodel.models import resolve_model
from flashcp.costmodel.profile import load_profile
from flashcp.costmodel.projection import project_step
from flashcp.planner.planning import plan_sequence
from flashcp.planner.registry import get_strategy
from flashcp.planner.strategies import flashcp2 as _search
from tests.plans import examples, packed

PROFILE = load_profile()
ROUNDING = 1e-12
"""The objective sums each kind's layers, the projection averages them: equal up to float rounding."""


def _slowdowns(lens, cp, name, gpus_per_node):
    """flashcp2's projected step time for the model over each peer's: a ratio per peer."""
    model = resolve_model(name)
    shape = model.attention_shape()
    topology = {"topology": f"{cp // gpus_per_node}x{gpus_per_node}"} if gpus_per_node else {}
    ours = plan_sequence("flashcp2", lens, cp, model=model, **topology)
    ours.validate(np.asarray(lens))

    def seconds(plan):
        return project_step(plan, shape, PROFILE, "auto", True, gpus_per_node=gpus_per_node).total

    mine = seconds(ours)
    return {peer: mine / seconds(plan_sequence(peer, lens, cp)) for peer in _search.PEERS}


@st.composite
def model_cases(draw):
    """Random document lengths of 4K to 32K tokens in all, a CP size, a topology and a model."""
    lens = draw(st.lists(st.one_of(st.integers(1, 300), st.integers(1, 4000), st.integers(1, 20000)), min_size=1,
                         max_size=30))
    while sum(lens) > 32768:
        lens.pop()
    if sum(lens) < 4096:
        lens.append(4096 - sum(lens))
    cp, gpus_per_node = draw(st.sampled_from([(4, 0), (8, 0), (16, 0), (16, 8)]))
    return lens, cp, gpus_per_node, draw(st.sampled_from(["llama-3-8b", "gemma-3-12b"]))


@examples(40)
@given(model_cases())
def test_flashcp2_is_never_slower_than_a_peer_for_the_model(case):
    lens, cp, gpus_per_node, name = case
    ratios = _slowdowns(lens, cp, name, gpus_per_node)
    assert max(ratios.values()) <= 1 + ROUNDING, ratios


@pytest.mark.parametrize("name", ["llama-3-8b", "gemma-3-12b", "gpt-oss-20b", "llama-4-scout", "qwen3-next-80b-a3b"])
def test_flashcp2_is_never_slower_than_a_peer_on_wlb_sequences(name):
    for lens in packed("wlb", 3, 32768, seed=7):
        for cp, gpus_per_node in ((8, 0), (16, 0), (16, 8)):
            ratios = _slowdowns(lens, cp, name, gpus_per_node)
            assert max(ratios.values()) <= 1 + ROUNDING, (cp, gpus_per_node, ratios)


def test_the_peers_are_planned_at_their_registry_defaults():
    assert get_strategy("flashcp+").defaults["target_imbalance"] == _search.PLUS_TARGET
    assert get_strategy("flashcp").defaults["target_imbalance"] == _search.PEER_FLASHCP_TARGET
    assert get_strategy("magi").defaults["chunk_size"] == _search.PEER_MAGI_CHUNK
    assert get_strategy("ptrr").defaults["chunk_size"] == _search.PEER_PTRR_CHUNK
    lens = packed("wlb", 1, 32768, seed=1)[0]
    for peer in _search.PEERS:
        assert plan_sequence(peer, lens, 8).shard_doc.size > 0
