"""The one size limit (flashcp.costmodel.limits), the same sentence for every command."""

import numpy as np
import pytest

from flashcp.costmodel.limits import MAX_CONTEXT_LEN, MAX_CP, check_context_len
from flashcp.costmodel.workload import workload


def test_the_longest_context_passes_and_one_more_token_does_not():
    check_context_len(MAX_CONTEXT_LEN)
    with pytest.raises(ValueError, match=r"16,777,217 is above the longest context flashcp plans, 16,777,216"):
        check_context_len(MAX_CONTEXT_LEN + 1)
    with pytest.raises(ValueError, match="^sequence length"):
        check_context_len(MAX_CONTEXT_LEN + 1, "sequence length")


def test_the_limit_keeps_every_workload_sum_times_cp_inside_int64():
    most = int(workload(0, MAX_CONTEXT_LEN)) * MAX_CP  # one document of the longest context, summed per rank
    assert most < np.iinfo(np.int64).max
