"""The plan validator (flashcp.planner.check): every kind of broken plan gets its error code, as
SequencePlan.validate says."""

import numpy as np
import pytest

from flashcp.errors import PlanError
from flashcp.planner import check
from flashcp.planner.plan import SequencePlan
from flashcp.planner.planning import plan_sequence


def _broken_plans():
    lens = [5, 3, 8]
    good = plan_sequence("flashcp", lens, 2)
    arrays = [good.shard_doc.copy(), good.shard_start.copy(), good.shard_len.copy(), good.shard_rank.copy()]
    yield "good", lens, arrays, check.OK
    a = [x.copy() for x in arrays]
    a[2][0] += 1  # rank 0's first shard of doc 0 grows into the next shard, its doc-2 shard shrinks
    a[2][4] -= 1
    yield "overlap", lens, a, check.BAD_COVERAGE
    a = [x.copy() for x in arrays]
    a[3][0] = 1 - a[3][0]
    yield "quota", lens, a, check.BAD_QUOTA
    a = [x.copy() for x in arrays]
    a[3][0] = 5
    yield "rank", lens, a, check.BAD_RANK
    a = [x[1:].copy() for x in arrays]
    yield "gap", lens, a, check.BAD_COVERAGE
    a = [x.copy() for x in arrays]
    a[0][0] = 9
    yield "doc", lens, a, check.BAD_DOC
    a = [x.copy() for x in arrays]
    a[2][0] = 0
    yield "empty", lens, a, check.BAD_LENGTH


BROKEN = ["good", "overlap", "quota", "rank", "gap", "doc", "empty"]


@pytest.mark.parametrize("label", BROKEN)
def test_check_batch_agrees_with_validate(label):
    # built here, not at collection: collecting the suite plans nothing (tests/conftest.py)
    cases = {case[0]: case[1:] for case in _broken_plans()}
    assert list(cases) == BROKEN
    lens, arrays, code = cases[label]
    offsets = np.array([0, len(lens)])
    shard_offsets = np.array([0, arrays[0].size])
    errors, *_ = check.check_batch(offsets, np.asarray(lens, np.int64), shard_offsets, *arrays, 2, 0.0)
    assert errors[0] == code, label
    plan = SequencePlan.from_arrays(*arrays, cp=2)
    if code == check.OK:
        plan.validate(lens)
    else:
        with pytest.raises(PlanError):
            plan.validate(lens)
