"""The model shape every price is computed for (flashcp.costmodel.shape)."""

import pytest

from flashcp.costmodel.comm import grad_bytes_per_token, kv_bytes_per_token
from flashcp.costmodel.shape import AttentionShape


def test_bytes_and_flops_by_hand():
    shape = AttentionShape(num_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2, hidden_mult=4.0)
    assert shape.kv_row_bytes == 2 * 8 * 128 * 2 == kv_bytes_per_token(8, 128, 2)
    assert shape.q_row_bytes == 32 * 128 * 2
    d, d_kv = 32 * 128, 8 * 128
    assert shape.token_flops() == 3 * (4 * d * d + 4 * d * d_kv + 4 * 4.0 * d * d)
    assert grad_bytes_per_token(8, 128, 2) == 2 * 8 * 128 * 4  # the reduce-scatter sums in float32
    assert grad_bytes_per_token(8, 128, 8) == 2 * 8 * 128 * 8
    assert shape.as_dict()["layers"] == 1


@pytest.mark.parametrize("bad", [dict(num_heads=0), dict(num_kv_heads=3), dict(head_dim=0), dict(layers=0),
                                 dict(dtype_bytes=0), dict(hidden_mult=0.0)])
def test_bad_shapes_are_refused(bad):
    with pytest.raises(ValueError, match="bad model shape"):
        AttentionShape(**{"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, **bad})
