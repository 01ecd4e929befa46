"""transformers integration in one process: flashcp as an attention implementation of stock models.

With a cp-1 plan cp_attention needs no process group, so a stock LlamaForCausalLM / Qwen2ForCausalLM
attending through flashcp must give the logits and gradients of the same model with transformers' own sdpa
attention on the packed sequence (which masks documents from position ids that restart at 0). The
multi-rank training comparison is in test_train_dist.py.
"""

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from flashcp.integrations.hf import (  # noqa: E402
    ATTN_IMPLEMENTATION,
    flashcp_attention_forward,
    hf_attention_kwargs,
    register_flashcp_attention,
    tiny_hf_model,
)
from flashcp.planner.plan import SequencePlan  # noqa: E402
from flashcp.runtime import CPAttnMeta  # noqa: E402

TOL = 1e-10
DOC_LENS = np.array([5, 1, 9, 3])


def whole_sequence_meta(doc_lens):
    """cp 1: one shard per document, all on rank 0."""
    n = len(doc_lens)
    plan = SequencePlan.from_arrays(np.arange(n), np.zeros(n), doc_lens, np.zeros(n), 1)
    return CPAttnMeta.from_plan(plan, doc_lens, 0)


def pair(arch):
    shape = dict(vocab_size=50, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64)
    flashcp = tiny_hf_model(arch, **shape, dtype=torch.float64)
    stock = tiny_hf_model(arch, **shape, dtype=torch.float64, attn_implementation="sdpa")
    stock.load_state_dict(flashcp.state_dict())
    return flashcp, stock


def positions(doc_lens):
    return torch.from_numpy(np.concatenate([np.arange(n) for n in doc_lens]))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_flashcp_attention_equals_stock_sdpa_on_a_packed_sequence(arch):
    flashcp, stock = pair(arch)
    assert flashcp.config._attn_implementation == ATTN_IMPLEMENTATION
    ids = torch.randint(0, 50, (1, int(DOC_LENS.sum())), generator=torch.Generator().manual_seed(0))
    pos = positions(DOC_LENS)[None]
    got = flashcp(input_ids=ids, position_ids=pos, use_cache=False,
                  **hf_attention_kwargs(whole_sequence_meta(DOC_LENS))).logits
    want = stock(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert (got - want).abs().max().item() < TOL
    got.square().sum().backward()
    want.square().sum().backward()
    stock_grads = dict(stock.named_parameters())
    err = max((p.grad - stock_grads[n].grad).abs().max().item() for n, p in flashcp.named_parameters())
    assert err < TOL, f"max |grad err| {err}"


def test_rope_follows_position_ids_per_document():
    # a document's logits do not depend on what precedes it in the packed sequence
    model, _ = pair("llama")
    ids = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(1))
    alone = model(input_ids=ids[:, 4:], position_ids=torch.arange(8)[None], use_cache=False,
                  **hf_attention_kwargs(whole_sequence_meta(np.array([8])))).logits
    packed = model(input_ids=ids, position_ids=positions([4, 8])[None], use_cache=False,
                   **hf_attention_kwargs(whole_sequence_meta(np.array([4, 8])))).logits
    assert (packed[:, 4:] - alone).abs().max().item() < TOL
    # RoPE is relative, so only positions consistent inside a document matter: numbering the second half of
    # a document from 0 again (as a rank that ignored its shard's start would) changes its logits
    restarted = model(input_ids=ids, position_ids=positions([4, 4, 4])[None], use_cache=False,
                      **hf_attention_kwargs(whole_sequence_meta(np.array([4, 8])))).logits
    assert (restarted[:, 8:] - alone[:, 4:]).abs().max().item() > 1e-6


def test_softmax_scale_is_passed_through():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, 6, 8, dtype=torch.float64, generator=gen) for h in (4, 2, 2))
    meta = whole_sequence_meta(np.array([6]))
    default, _ = flashcp_attention_forward(None, q, k, v, None, scaling=None, flashcp_meta=meta)
    explicit, _ = flashcp_attention_forward(None, q, k, v, None, scaling=8 ** -0.5, flashcp_meta=meta)
    other, _ = flashcp_attention_forward(None, q, k, v, None, scaling=0.9, flashcp_meta=meta)
    assert default.shape == (1, 6, 4, 8)
    assert (default - explicit).abs().max().item() < TOL
    assert (default - other).abs().max().item() > 1e-3


def test_refusals():
    q = torch.zeros(1, 4, 3, 8)
    k = torch.zeros(1, 2, 3, 8)
    meta = whole_sequence_meta(np.array([3]))
    cases = [(dict(), "needs this rank's CPAttnMeta"),
             (dict(flashcp_meta=meta, dropout=0.1), "attention_dropout"),
             (dict(flashcp_meta=meta, sliding_window=0), "window must be a positive number of tokens"),
             (dict(flashcp_meta=meta, attention_mask=torch.ones(1, 1, 3, 3)), "without attention_mask")]
    for kwargs, message in cases:
        mask = kwargs.pop("attention_mask", None)
        with pytest.raises(ValueError, match=message):
            flashcp_attention_forward(None, q, k, k, mask, **kwargs)
    with pytest.raises(ValueError, match="batch size 1"):
        flashcp_attention_forward(None, q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1),
                                  k.expand(2, -1, -1, -1), None, flashcp_meta=meta)
    with pytest.raises(ValueError, match="contains 'flash'"):
        register_flashcp_attention("flashcp")
    with pytest.raises(ValueError, match="unknown architecture"):
        tiny_hf_model("gpt2", vocab_size=8, dim=8, num_layers=1, num_heads=2, num_kv_heads=1, ffn_dim=8)
