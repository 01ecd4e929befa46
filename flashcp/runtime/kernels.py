"""Variable-length causal attention kernels: ``flash_attn``, ``torch_varlen`` and a pure-torch ``reference``.

This is the only module that imports ``flash_attn`` (lazily, on first use). Every backend computes the same
thing: for each sequence ``i`` of a packed batch, the queries ``q[cu_q[i]:cu_q[i+1]]`` attend to the keys
``k[cu_k[i]:cu_k[i+1]]`` with a *bottom-right aligned* causal mask. A query shard ``[start, start+n)`` of a
document therefore attends to the key prefix ``[0, start+n)``: query ``j`` sees keys ``0 .. start+j``. Every
sequence needs at least as many keys as queries.

Block-wise attention (the ``ring`` comm mode) needs two more entry points, not differentiable themselves:
``varlen_attention_forward`` returns the output *and* its log-sum-exp, and may drop the causal mask (a query
attends to every key of its sequence); ``varlen_attention_backward`` computes dq, dk, dv of one block from
the *merged* output and log-sum-exp of all blocks, so that per-block gradients add up to the exact gradient
(``P = exp(S - lse)``, ``dS = P * (dO V^T - rowsum(dO * O))``). The backends use flash_attn's
``_flash_attn_varlen_backward`` and torch's ``torch_attn::_varlen_attn_backward`` op; the reference backend
uses, on CPU in float32/float64, the CPU flash-attention ops that ``scaled_dot_product_attention`` itself runs
there (they return and take the log-sum-exp; exact in float64), and elsewhere the same formulas written out in
PyTorch.

Shape legend: ``T`` packed query tokens, ``S`` packed key tokens, ``H`` query heads, ``K`` key/value heads
(``H % K == 0``; grouped-query attention when ``K < H``), ``D`` head dim, ``B`` sequences in the batch.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math

import torch
import torch.nn.functional as F

from flashcp.errors import FlashcpError

__all__ = ["BACKENDS", "BackendUnavailableError", "backend_available", "lse_dtype", "resolve_backend",
           "varlen_attention", "varlen_attention_backward", "varlen_attention_forward"]

BACKENDS = ("flash_attn", "torch_varlen", "reference")
"""Kernel backends in the order ``"auto"`` tries them."""

_HALF_DTYPES = (torch.float16, torch.bfloat16)


class BackendUnavailableError(FlashcpError):
    """The requested attention backend cannot run on these tensors (not installed, wrong device or dtype)."""


@functools.cache
def _flash_attn_func():
    if importlib.util.find_spec("flash_attn") is None:
        return None
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


@functools.cache
def _flash_attn_lse_funcs():
    """``(flash_attn_varlen_func, _flash_attn_varlen_backward, its parameters)`` or None."""
    if _flash_attn_func() is None:
        return None
    try:
        from flash_attn.flash_attn_interface import _flash_attn_varlen_backward
    except ImportError:
        return None
    return _flash_attn_func(), _flash_attn_varlen_backward, inspect.signature(
        _flash_attn_varlen_backward).parameters


@functools.cache
def _torch_varlen_lse_ops():
    """``(forward op, backward op, {op: argument names})`` of torch's varlen attention, or None."""
    if _torch_varlen_func()[0] is None:
        return None
    ops = torch.ops.torch_attn
    if not (hasattr(ops, "_varlen_attn") and hasattr(ops, "_varlen_attn_backward")):
        return None
    forward, backward = ops._varlen_attn, ops._varlen_attn_backward
    names = {op: tuple(a.name for a in op.default._schema.arguments) for op in (forward, backward)}
    return forward, backward, names


def _call_by_schema(op, names, required: list, optional: dict):
    """``op(*required, **the optional arguments its schema has)``."""
    return op(*required, **{name: value for name, value in optional.items() if name in names[op]})


@functools.cache
def _torch_varlen_func():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, {}
    params = inspect.signature(varlen_attn).parameters
    # The causal flag moved between torch releases: ``is_causal=True`` in early versions,
    # ``window_size=(-1, 0)`` later. Both select the same bottom-right aligned flash kernel.
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None, {}
    return varlen_attn, {"causal": causal, "enable_gqa": "enable_gqa" in params, "scale": "scale" in params}


def _why_unavailable(backend: str, q: torch.Tensor) -> str | None:
    """None when ``backend`` can run on tensors like ``q``, else the reason in a few words."""
    if backend == "reference":
        return None
    if backend not in BACKENDS:
        return f"unknown backend '{backend}' (choose from {', '.join(BACKENDS)} or auto)"
    if not q.is_cuda:
        return f"{backend} needs CUDA tensors, got {q.device.type}"
    if q.dtype not in _HALF_DTYPES:
        return f"{backend} needs float16 or bfloat16, got {q.dtype}"
    if backend == "flash_attn" and _flash_attn_func() is None:
        return "flash_attn is not installed (pip install flash-attn)"
    if backend == "torch_varlen" and _torch_varlen_func()[0] is None:
        return f"torch {torch.__version__} has no usable torch.nn.attention.varlen.varlen_attn"
    return None


def backend_available(backend: str, q: torch.Tensor) -> bool:
    """Whether ``backend`` can run on tensors like ``q`` (device, dtype, installed packages)."""
    return _why_unavailable(backend, q) is None


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """The concrete backend for ``backend`` (``"auto"`` takes the first of BACKENDS that can run on ``q``).

    Raises BackendUnavailableError naming the reason when an explicitly requested backend cannot run.
    """
    if backend == "auto":
        return next(b for b in BACKENDS if backend_available(b, q))
    why = _why_unavailable(backend, q)
    if why is not None:
        raise BackendUnavailableError(f"attention backend '{backend}' cannot run here: {why}")
    return backend


def varlen_attention(q_THD: torch.Tensor, k_SKD: torch.Tensor, v_SKD: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, backend: str = "auto",
                     softmax_scale: float | None = None) -> torch.Tensor:
    """Bottom-right causal attention over packed variable-length sequences; returns ``out_THD``.

    Args:
        q_THD: queries, (T, H, D).
        k_SKD: keys, (S, K, D), same dtype and device; ``H % K == 0``.
        v_SKD: values, (S, K, D).
        cu_seqlens_q: (B + 1,) int32 offsets of each sequence's queries in ``q_THD``, on q's device.
        cu_seqlens_k: (B + 1,) int32 offsets of each sequence's keys in ``k_SKD``; every sequence has at least
            as many keys as queries.
        max_seqlen_q: longest query sequence.
        max_seqlen_k: longest key sequence.
        backend: one of BACKENDS or ``"auto"``.
        softmax_scale: the factor applied to ``q . k`` before the softmax; None means ``1 / sqrt(D)``.

    Differentiable in q, k and v with every backend.
    """
    backend = resolve_backend(backend, q_THD)
    if q_THD.shape[0] == 0:
        return q_THD.clone()
    if backend == "flash_attn":
        return _flash_attn_func()(q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  softmax_scale=softmax_scale, causal=True)
    if backend == "torch_varlen":
        varlen_attn, options = _torch_varlen_func()
        kwargs = dict(options["causal"])
        if k_SKD.shape[1] != q_THD.shape[1] and options["enable_gqa"]:
            kwargs["enable_gqa"] = True
        if softmax_scale is not None:
            if options["scale"]:
                kwargs["scale"] = softmax_scale
            else:  # releases without a scale argument: fold the ratio to the default scale into q
                q_THD = q_THD * (softmax_scale * math.sqrt(q_THD.shape[-1]))
        return varlen_attn(q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           **kwargs)
    return reference_varlen_attention(q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, softmax_scale)


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


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of log-sum-exps and partial-output merges for inputs of ``dtype``: float32 or wider."""
    return torch.promote_types(dtype, torch.float32)


def _lse_backend(backend: str, q: torch.Tensor) -> str:
    backend = resolve_backend(backend, q)
    if backend == "flash_attn" and _flash_attn_lse_funcs() is None:
        raise BackendUnavailableError("attention backend 'flash_attn' cannot run block-wise attention here: "
                                      "flash_attn.flash_attn_interface has no _flash_attn_varlen_backward")
    if backend == "torch_varlen" and _torch_varlen_lse_ops() is None:
        raise BackendUnavailableError(f"attention backend 'torch_varlen' cannot run block-wise attention "
                                      f"with torch {torch.__version__}: it lacks the torch_attn varlen ops")
    return backend


def _lse_TH(lse: torch.Tensor, num_tokens: int, num_heads: int, backend: str) -> torch.Tensor:
    # recent flash-attn 2 releases and torch's varlen op return the varlen log-sum-exp packed, (H, T) float32
    if lse.shape != (num_heads, num_tokens):
        raise BackendUnavailableError(f"attention backend '{backend}' returned a log-sum-exp of shape "
                                      f"{tuple(lse.shape)}, not the packed (H, T) = ({num_heads}, "
                                      f"{num_tokens}) that block-wise attention needs; upgrade flash-attn")
    return lse.transpose(0, 1)


def varlen_attention_forward(q_THD: torch.Tensor, k_SKD: torch.Tensor, v_SKD: torch.Tensor,
                             cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                             max_seqlen_k: int, causal: bool, backend: str = "auto"
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen attention returning ``(out_THD, lse_TH)``; not differentiable (for use in autograd Functions).

    Args: as ``varlen_attention``, plus ``causal``: True for the bottom-right causal mask (every sequence
    then needs at least as many keys as queries), False to let each query see every key of its sequence.

    ``lse_TH`` is ``log(sum_j exp(q . k_j / sqrt(D)))`` over the keys each query sees, (T, H), in
    ``lse_dtype(q.dtype)``. Every sequence must have at least one key.
    """
    backend = _lse_backend(backend, q_THD)
    num_tokens, num_heads = q_THD.shape[0], q_THD.shape[1]
    if num_tokens == 0:
        return q_THD.clone(), q_THD.new_zeros((0, num_heads), dtype=lse_dtype(q_THD.dtype))
    if backend == "flash_attn":
        forward = _flash_attn_lse_funcs()[0]
        out, lse, _ = forward(q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              causal=causal, return_attn_probs=True)
        return out, _lse_TH(lse, num_tokens, num_heads, backend)
    if backend == "torch_varlen":
        forward, _, names = _torch_varlen_lse_ops()
        out, lse, _ = _call_by_schema(
            forward, names, [q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k],
            {"is_causal": causal, "window_size": [-1, 0] if causal else [-1, -1],
             "enable_gqa": k_SKD.shape[1] != num_heads})
        return out, _lse_TH(lse, num_tokens, num_heads, backend)
    return _reference_forward(q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, causal)


def varlen_attention_backward(grad_out_THD: torch.Tensor, q_THD: torch.Tensor, k_SKD: torch.Tensor,
                              v_SKD: torch.Tensor, out_THD: torch.Tensor, lse_TH: torch.Tensor,
                              cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                              max_seqlen_k: int, causal: bool, backend: str = "auto"
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq_THD, dk_SKD, dv_SKD)`` of one block of keys, given the output and log-sum-exp over *all* blocks.

    Args:
        grad_out_THD: gradient of the merged output, (T, H, D), q's dtype.
        q_THD: this block's queries, (T, H, D).
        k_SKD: this block's keys, (S, K, D).
        v_SKD: this block's values, (S, K, D).
        out_THD: the merged output of these queries, (T, H, D), q's dtype.
        lse_TH: the merged log-sum-exp of these queries, (T, H), ``lse_dtype(q.dtype)``.
        cu_seqlens_q: (B + 1,) int32 query offsets, as in ``varlen_attention_forward``.
        cu_seqlens_k: (B + 1,) int32 key offsets.
        max_seqlen_q: longest query sequence.
        max_seqlen_k: longest key sequence.
        causal: the mask the forward call used.
        backend: one of BACKENDS or ``"auto"``.

    The gradients are in the inputs' dtypes; summed over the blocks they are the exact gradient of the
    attention over all blocks.
    """
    backend = _lse_backend(backend, q_THD)
    if q_THD.shape[0] == 0:
        return q_THD.clone(), torch.zeros_like(k_SKD), torch.zeros_like(v_SKD)
    grad_out_THD, lse_HT = grad_out_THD.contiguous(), lse_TH.transpose(0, 1).float().contiguous()
    if backend == "flash_attn":
        _, backward, params = _flash_attn_lse_funcs()
        dq, dk, dv = torch.empty_like(q_THD), torch.empty_like(k_SKD), torch.empty_like(v_SKD)
        known = {"dout": grad_out_THD, "q": q_THD, "k": k_SKD, "v": v_SKD, "out": out_THD,
                 "softmax_lse": lse_HT, "dq": dq, "dk": dk, "dv": dv, "cu_seqlens_q": cu_seqlens_q,
                 "cu_seqlens_k": cu_seqlens_k, "max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k,
                 "dropout_p": 0.0, "softmax_scale": q_THD.shape[-1] ** -0.5, "causal": causal,
                 "window_size": (-1, 0) if causal else (-1, -1), "window_size_left": -1,
                 "window_size_right": 0 if causal else -1, "softcap": 0.0, "alibi_slopes": None,
                 "deterministic": False, "rng_state": None}
        # its signature moved between releases (window_size -> window_size_left/right, softcap, ...)
        missing = [n for n, p in params.items() if n not in known and p.default is inspect.Parameter.empty]
        if missing:
            raise BackendUnavailableError(f"flash_attn's _flash_attn_varlen_backward needs arguments flashcp "
                                          f"does not know: {', '.join(missing)}")
        backward(**{n: known[n] for n in params if n in known})
        return dq, dk, dv
    if backend == "torch_varlen":
        _, backward, names = _torch_varlen_lse_ops()
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q_THD.device)  # no dropout
        return _call_by_schema(
            backward, names, [grad_out_THD, q_THD, k_SKD, v_SKD, out_THD, lse_HT, cu_seqlens_q, cu_seqlens_k,
                              max_seqlen_q, max_seqlen_k, causal, rng_state],
            {"window_size": [-1, 0] if causal else [-1, -1]})
    return _reference_backward(grad_out_THD, q_THD, k_SKD, v_SKD, out_THD, lse_TH, cu_seqlens_q, cu_seqlens_k,
                               causal)


def _reference_scores(q_QHD, k_KKD, group: int, causal: bool):
    """Scaled scores (H, Q, Kn) in the lse dtype, -inf where masked; and the heads-repeated keys."""
    acc = lse_dtype(q_QHD.dtype)
    num_q, num_k = q_QHD.shape[0], k_KKD.shape[0]
    k_full = k_KKD.to(acc).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q_QHD.to(acc), k_full) / math.sqrt(q_QHD.shape[-1])
    if causal:
        if num_k < num_q:
            raise ValueError(f"a causal sequence has {num_q} queries but only {num_k} keys")
        # bottom-right alignment: query j is the (num_k - num_q + j)-th key position
        keep = (torch.arange(num_k, device=q_QHD.device)[None, :]
                <= torch.arange(num_q, device=q_QHD.device)[:, None] + (num_k - num_q))
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores, k_full


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


def _reference_forward(q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, causal):
    acc = lse_dtype(q_THD.dtype)
    group = q_THD.shape[1] // k_SKD.shape[1]
    out = torch.empty_like(q_THD)
    lse = q_THD.new_empty(q_THD.shape[:2], dtype=acc)
    use_flash = _use_cpu_flash(q_THD)
    for qs, ks in _sequences(cu_seqlens_q, cu_seqlens_k):
        if use_flash:
            (q, k, v), is_causal, mask = _cpu_flash_inputs(q_THD[qs], k_SKD[ks], v_SKD[ks], group, causal)
            out_1HQD, lse_1HQ = _cpu_flash_ops()[0](q, k, v, 0.0, is_causal, attn_mask=mask)
            out[qs], lse[qs] = out_1HQD[0].transpose(0, 1), lse_1HQ[0].transpose(0, 1)
            continue
        scores, _ = _reference_scores(q_THD[qs], k_SKD[ks], group, causal)
        lse_HQ = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse_HQ[..., None])
        out[qs] = torch.einsum("hqk,khd->qhd", probs, v_SKD[ks].to(acc).repeat_interleave(group, dim=1))
        lse[qs] = lse_HQ.transpose(0, 1)
    return out, lse


def _reference_backward(grad_out_THD, q_THD, k_SKD, v_SKD, out_THD, lse_TH, cu_seqlens_q, cu_seqlens_k,
                        causal):
    acc = lse_dtype(q_THD.dtype)
    num_kv_heads, head_dim = k_SKD.shape[1], k_SKD.shape[2]
    group = q_THD.shape[1] // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim)
    dq, dk, dv = torch.empty_like(q_THD), torch.zeros_like(k_SKD), torch.zeros_like(v_SKD)
    use_flash = _use_cpu_flash(q_THD)
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
        scores, k_full = _reference_scores(q_THD[qs], k_SKD[ks], group, causal)
        probs = torch.exp(scores - lse_TH[qs].to(acc).transpose(0, 1)[..., None])  # (H, Q, Kn)
        dout = grad_out_THD[qs].to(acc)
        v_full = v_SKD[ks].to(acc).repeat_interleave(group, dim=1)
        dprobs = torch.einsum("qhd,khd->hqk", dout, v_full)
        delta = (dout * out_THD[qs].to(acc)).sum(-1).transpose(0, 1)[..., None]  # (H, Q, 1)
        dscores = probs * (dprobs - delta) * scale
        dq[qs] = torch.einsum("hqk,khd->qhd", dscores, k_full)
        dk[ks] = torch.einsum("hqk,qhd->khd", dscores, q_THD[qs].to(acc)).view(
            num_k, num_kv_heads, group, head_dim).sum(2)
        dv[ks] = torch.einsum("hqk,qhd->khd", probs, dout).view(num_k, num_kv_heads, group, head_dim).sum(2)
    return dq, dk, dv
