"""The baselines' kernels (llama3, perdoc, ring) against the plain-Python references and by hand."""

from hypothesis import given

from flashcp.planner.planning import plan_sequence
from tests.plans import as_tuples, assert_same_as_reference, examples, mixed_sequences


@examples(400)
@given(case=mixed_sequences(max_docs=12, max_len=400))
def test_llama3_equals_reference(case):
    lens, cp = case
    assert_same_as_reference("llama3", lens, cp)


def test_llama3_by_hand():
    # C=16, N=2: chunks of 4 tokens; rank 0 gets [0,4) and [12,16), rank 1 gets [4,12)
    plan = plan_sequence("llama3", [6, 10], 2)
    assert as_tuples(plan) == [(0, 0, 4, 0), (1, 6, 4, 0), (0, 4, 2, 1), (1, 0, 6, 1)]


def test_perdoc_remainders_round_robin():
    # 2N = 4 chunks of 1 token each; doc 0 (5 tokens) has 1 extra token (rank 0, early chunk), doc 1
    # (6 tokens) 2 extras dealt on from the pointer: rank 1 then rank 0 (early chunks). Rank 1's two
    # chunks touch and merge. Tokens 6 and 5: the quotas of C=11 over 2 ranks.
    plan = plan_sequence("perdoc", [5, 6], 2)
    assert as_tuples(plan) == [(0, 0, 2, 0), (0, 4, 1, 0), (1, 0, 2, 0), (1, 5, 1, 0), (0, 2, 2, 1),
                               (1, 2, 3, 1)]
