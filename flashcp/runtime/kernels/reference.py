"""The reference kernels: any device and dtype (float64 included), every layer kind.

The differentiable attention is ``scaled_dot_product_attention`` one sequence at a time with an explicit
bottom-right causal mask. The log-sum-exp forward and the block-wise backward use, on CPU in float32/float64,
the CPU flash-attention ops that ``scaled_dot_product_attention`` itself runs there (they return and take the
log-sum-exp; exact in float64), and elsewhere the same formulas written out in PyTorch. They loop over
sequences in Python with a host sync per call: for CPU, tests and checks.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from flashcp.runtime.kernels.library import KINDS, Api, Library, lse_dtype

__all__ = ["REFERENCE", "reference_varlen_attention"]


def reference_varlen_attention(q_THD: torch.Tensor, k_SKD: torch.Tensor, v_SKD: torch.Tensor,
                               cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                               softmax_scale: float | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` one sequence at a time with an explicit bottom-right causal mask.

    Runs on any device and dtype (float64 included); loops over sequences: for CPU, tests and checks.
    ``softmax_scale`` None means ``1 / sqrt(D)``.
    """
    scale = 1.0 / math.sqrt(q_THD.shape[-1]) if softmax_scale is None else float(softmax_scale)
    num_heads, num_kv_heads = q_THD.shape[1], k_SKD.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} must be a multiple of key/value heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs = []
    for i in range(len(cu_q) - 1):
        num_q, num_k = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        if num_k < num_q:
            raise ValueError(f"sequence {i} has {num_q} queries but only {num_k} keys")
        q_HQD = q_THD[cu_q[i]:cu_q[i + 1]].transpose(0, 1)
        k_HKD = k_SKD[cu_k[i]:cu_k[i + 1]].transpose(0, 1).repeat_interleave(group, dim=0)
        v_HKD = v_SKD[cu_k[i]:cu_k[i + 1]].transpose(0, 1).repeat_interleave(group, dim=0)
        # bottom-right alignment: query j is the (num_k - num_q + j)-th key position
        keep_QK = (torch.arange(num_k, device=q_THD.device)[None, :]
                   <= torch.arange(num_q, device=q_THD.device)[:, None] + (num_k - num_q))
        out_HQD = F.scaled_dot_product_attention(q_HQD, k_HKD, v_HKD, attn_mask=keep_QK, scale=scale)
        outs.append(out_HQD.transpose(0, 1))
    return torch.cat(outs) if outs else q_THD.new_zeros(q_THD.shape)


# ---------------------------------------------------------------- the log-sum-exp kernels

def _keep_mask(num_q: int, num_k: int, device, window: int | None = None,
               chunk: int | None = None) -> torch.Tensor:
    """(Q, Kn) bool: the bottom-right causal mask, narrowed to a window or a chunk of document positions."""
    if num_k < num_q:
        raise ValueError(f"a causal sequence has {num_q} queries but only {num_k} keys")
    # bottom-right alignment: query j is the (num_k - num_q + j)-th key position
    query_pos = torch.arange(num_q, device=device)[:, None] + (num_k - num_q)
    key_pos = torch.arange(num_k, device=device)[None, :]
    keep = key_pos <= query_pos
    if window is not None:
        keep &= key_pos > query_pos - window
    if chunk is not None:
        keep &= key_pos >= query_pos // chunk * chunk
    return keep


def _reference_scores(q_QHD, k_KKD, group: int, causal: bool, window: int | None = None,
                      chunk: int | None = None, softcap: float | None = None):
    """Scaled (and soft-capped) scores (H, Q, Kn) in the lse dtype, -inf where masked.

    Also the heads-repeated keys and ``d capped / d scaled`` (None without a soft-cap).
    """
    acc = lse_dtype(q_QHD.dtype)
    k_full = k_KKD.to(acc).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q_QHD.to(acc), k_full) / math.sqrt(q_QHD.shape[-1])
    cap_grad = None
    if softcap is not None:
        tanh = torch.tanh(scores / softcap)
        scores, cap_grad = softcap * tanh, 1 - tanh * tanh
    if causal:
        scores = scores.masked_fill(~_keep_mask(q_QHD.shape[0], k_KKD.shape[0], q_QHD.device, window, chunk),
                                    float("-inf"))
    return scores, k_full, cap_grad


def _sequences(cu_seqlens_q, cu_seqlens_k):
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        if cu_k[i + 1] == cu_k[i]:
            raise ValueError(f"sequence {i} has no keys")
        yield slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])


@functools.cache
def _cpu_flash_ops():
    """The CPU flash-attention forward / backward ops (what SDPA runs on CPU), or None when missing."""
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_flash_attention_for_cpu_backward")
    if not all(hasattr(aten, name) for name in names):
        return None
    return tuple(getattr(aten, name) for name in names)


def _use_cpu_flash(q_THD: torch.Tensor) -> bool:
    return q_THD.device.type == "cpu" and q_THD.dtype in (torch.float32, torch.float64) and \
        _cpu_flash_ops() is not None


def _cpu_flash_inputs(q_QHD, k_KKD, v_KKD, group: int, causal: bool):
    """``((q, k, v) as (1, H, n, D) with K/V heads repeated, is_causal, additive mask or None)``."""
    num_q, num_k = q_QHD.shape[0], k_KKD.shape[0]
    tensors = tuple(t.repeat_interleave(r, dim=1).transpose(0, 1).unsqueeze(0)
                    for t, r in ((q_QHD, 1), (k_KKD, group), (v_KKD, group)))
    if not causal or num_q == num_k:  # the op's causal mask is top-left aligned: right only when square
        return tensors, causal, None
    if num_k < num_q:
        raise ValueError(f"a causal sequence has {num_q} queries but only {num_k} keys")
    keep = (torch.arange(num_k, device=q_QHD.device)[None, :]
            <= torch.arange(num_q, device=q_QHD.device)[:, None] + (num_k - num_q))
    mask = torch.zeros(num_q, num_k, dtype=q_QHD.dtype, device=q_QHD.device).masked_fill(~keep, float("-inf"))
    return tensors, False, mask


def _reference_forward(q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, causal, window=None, chunk=None,
                       softcap=None):
    acc = lse_dtype(q_THD.dtype)
    group = q_THD.shape[1] // k_SKD.shape[1]
    out = torch.empty_like(q_THD)
    lse = q_THD.new_empty(q_THD.shape[:2], dtype=acc)
    use_flash = _use_cpu_flash(q_THD) and window is None and chunk is None and softcap is None
    for qs, ks in _sequences(cu_seqlens_q, cu_seqlens_k):
        if use_flash:
            (q, k, v), is_causal, mask = _cpu_flash_inputs(q_THD[qs], k_SKD[ks], v_SKD[ks], group, causal)
            out_1HQD, lse_1HQ = _cpu_flash_ops()[0](q, k, v, 0.0, is_causal, attn_mask=mask)
            out[qs], lse[qs] = out_1HQD[0].transpose(0, 1), lse_1HQ[0].transpose(0, 1)
            continue
        scores, _, _ = _reference_scores(q_THD[qs], k_SKD[ks], group, causal, window, chunk, softcap)
        lse_HQ = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse_HQ[..., None])
        out[qs] = torch.einsum("hqk,khd->qhd", probs, v_SKD[ks].to(acc).repeat_interleave(group, dim=1))
        lse[qs] = lse_HQ.transpose(0, 1)
    return out, lse


def _reference_backward(grad_out_THD, q_THD, k_SKD, v_SKD, out_THD, lse_TH, cu_seqlens_q, cu_seqlens_k,
                        causal, window=None, chunk=None, softcap=None):
    acc = lse_dtype(q_THD.dtype)
    num_kv_heads, head_dim = k_SKD.shape[1], k_SKD.shape[2]
    group = q_THD.shape[1] // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim)
    dq, dk, dv = torch.empty_like(q_THD), torch.zeros_like(k_SKD), torch.zeros_like(v_SKD)
    use_flash = _use_cpu_flash(q_THD) and window is None and chunk is None and softcap is None
    for qs, ks in _sequences(cu_seqlens_q, cu_seqlens_k):
        num_k = ks.stop - ks.start
        if use_flash:
            (q, k, v), is_causal, mask = _cpu_flash_inputs(q_THD[qs], k_SKD[ks], v_SKD[ks], group, causal)
            dout, out = (t[qs].transpose(0, 1).unsqueeze(0) for t in (grad_out_THD, out_THD))
            lse = lse_TH[qs].to(q_THD.dtype).transpose(0, 1).unsqueeze(0).contiguous()
            dq_1, dk_1, dv_1 = _cpu_flash_ops()[1](dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask)
            dq[qs] = dq_1[0].transpose(0, 1)
            dk[ks] = dk_1[0].transpose(0, 1).reshape(num_k, num_kv_heads, group, head_dim).sum(2)
            dv[ks] = dv_1[0].transpose(0, 1).reshape(num_k, num_kv_heads, group, head_dim).sum(2)
            continue
        scores, k_full, cap_grad = _reference_scores(q_THD[qs], k_SKD[ks], group, causal, window, chunk, softcap)
        probs = torch.exp(scores - lse_TH[qs].to(acc).transpose(0, 1)[..., None])  # (H, Q, Kn)
        dout = grad_out_THD[qs].to(acc)
        v_full = v_SKD[ks].to(acc).repeat_interleave(group, dim=1)
        dprobs = torch.einsum("qhd,khd->hqk", dout, v_full)
        delta = (dout * out_THD[qs].to(acc)).sum(-1).transpose(0, 1)[..., None]  # (H, Q, 1)
        dscores = probs * (dprobs - delta) * scale
        if cap_grad is not None:
            dscores = dscores * cap_grad
        dq[qs] = torch.einsum("hqk,khd->qhd", dscores, k_full)
        dk[ks] = torch.einsum("hqk,qhd->khd", dscores, q_THD[qs].to(acc)).view(
            num_k, num_kv_heads, group, head_dim).sum(2)
        dv[ks] = torch.einsum("hqk,qhd->khd", probs, dout).view(num_k, num_kv_heads, group, head_dim).sum(2)
    return dq, dk, dv


def _attention(api: Api, q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               softmax_scale):
    return reference_varlen_attention(q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, softmax_scale)


def _forward(api: Api, q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window,
             chunk, softcap):
    return _reference_forward(q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, causal, window, chunk, softcap)


def _backward(api: Api, grad_out_THD, q_THD, k_SKD, v_SKD, out_THD, lse_TH, cu_seqlens_q, cu_seqlens_k,
              max_seqlen_q, max_seqlen_k, causal, window, chunk, softcap):
    return _reference_backward(grad_out_THD.contiguous(), q_THD, k_SKD, v_SKD, out_THD, lse_TH, cu_seqlens_q,
                               cu_seqlens_k, causal, window, chunk, softcap)


def _load() -> Api:
    return Api(attention=reference_varlen_attention, forward=_reference_forward, backward=_reference_backward,
               why_not_blockwise=None)


REFERENCE = Library(
    name="reference", load=_load, min_capability=None, dtypes=None, head_dims=lambda capability, head_dim: True,
    kinds=frozenset(KINDS), kinds_declared=False, auto_majors=None,
    attention=_attention, forward=_forward, backward=_backward)
"""The reference kernels; ``"auto"`` takes them for tensors off CUDA and, warning once, when no GPU kernel can run."""
