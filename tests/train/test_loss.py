"""The training loss (flashcp.train.loss): summed next-token cross-entropy, -100 ignored, float32 or wider."""

import torch

from flashcp.runtime.loader import IGNORE_INDEX
from flashcp.train.loss import causal_lm_loss_sum


def test_the_sum_over_labels_equals_the_plain_formula():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 11, dtype=torch.float64, generator=gen)
    labels = torch.tensor([3, 0, IGNORE_INDEX, 10, 5, IGNORE_INDEX, 1, 1, 7])
    keep = labels != IGNORE_INDEX
    expected = -(logits.log_softmax(-1)[keep, labels[keep]]).sum()
    assert torch.allclose(causal_lm_loss_sum(logits, labels), expected, rtol=1e-12, atol=0)
    # the local sums of any split of the tokens add up to the whole sequence's (what CP ranks return)
    parts = sum(causal_lm_loss_sum(logits[a:b], labels[a:b]) for a, b in ((0, 4), (4, 5), (5, 9)))
    assert torch.allclose(parts, expected, rtol=1e-12, atol=0)


def test_half_precision_logits_are_summed_in_float32():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 50, generator=gen)
    labels = torch.randint(0, 50, (64,), generator=gen)
    loss = causal_lm_loss_sum(logits.to(torch.bfloat16), labels)
    assert loss.dtype == torch.float32
    exact = causal_lm_loss_sum(logits.to(torch.bfloat16).double(), labels)
    assert abs(loss.double() - exact).item() < 1e-4 * exact.item()
