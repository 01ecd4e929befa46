"""What every attention library module shares: the ``Library`` record, importing, calling an entry point.

A ``Library`` says how one library loads, what it needs (device, dtype, head dims, layer kinds) and its three
entry points. The GPU libraries write theirs on head dims padded to a multiple of 8 (``pad_attention``,
``pad_forward``, ``pad_backward`` wrap them into the record's entry points); their parameters moved between
releases, so ``call`` passes each the arguments it declares (``parameters``).

Shape legend: ``T`` packed query tokens, ``S`` packed key tokens, ``H`` query heads, ``K`` key/value heads,
``D`` head dim, ``P`` head dim padded to a multiple of 8.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from flashcp.errors import FlashcpError

__all__ = ["HALF_DTYPES", "KINDS", "Api", "BackendFallbackWarning", "BackendUnavailableError", "Library",
           "Unavailable", "attribute", "call", "chunk_segments", "declares", "flash_attention", "fold_softmax_scale",
           "import_module", "lse_dtype", "pad_attention", "pad_backward", "pad_forward", "padded_head_dim",
           "parameters", "probs_forward", "up_to_256", "version_of"]

HALF_DTYPES = (torch.float16, torch.bfloat16)
"""The dtypes the GPU libraries take."""
KINDS = ("chunk", "window", "softcap")
"""The layer kinds a kernel call may carry (``flashcp.runtime.layer_kinds``), in the order they are checked.

Learned sinks are not among them: ``layer_kinds`` applies them from the log-sum-exp, on every library."""


class BackendUnavailableError(FlashcpError):
    """The requested attention backend cannot run on these tensors (not installed, wrong device or dtype)."""


class BackendFallbackWarning(UserWarning):
    """``backend="auto"`` skipped an installed backend, or must run the reference kernel on a GPU."""


@dataclass(frozen=True, slots=True)
class Api:
    """What one library's import provides."""

    attention: Callable
    """The differentiable varlen attention function."""
    forward: Callable | None
    """The entry point that returns the log-sum-exp (flash-attn's: ``attention`` itself; None when this release
    has none); its parameters say which layer kinds it takes."""
    backward: Callable | None
    """The block-wise backward entry point (None when this release has none)."""
    why_not_blockwise: str | None
    """Why this release cannot run block-wise attention, or None."""


class Unavailable(Exception):
    """A library that cannot load; ``installed``: whether it is there (and ``auto`` must say it skipped it)."""

    def __init__(self, reason: str, installed: bool):
        super().__init__(reason)
        self.installed = installed


@dataclass(frozen=True, kw_only=True, slots=True)
class Library:
    """One attention library flashcp calls: how it loads, what it needs, and its three entry points.

    The entry points take the unpadded tensors and the layer kind (window W, chunk K, soft-cap c, each None
    when not used); the first argument is what ``load`` returned:

    - ``attention(api, q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      softmax_scale) -> out_THD``, differentiable, bottom-right causal;
    - ``forward(api, q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
      window, chunk, softcap) -> (out_THD, lse_TH)``, the log-sum-exp in ``lse_dtype(q.dtype)``;
    - ``backward(api, grad_out_THD, q_THD, k_SKD, v_SKD, out_THD, lse_TH, cu_seqlens_q, cu_seqlens_k,
      max_seqlen_q, max_seqlen_k, causal, window, chunk, softcap) -> (dq_THD, dk_SKD, dv_SKD)``.
    """

    name: str
    """The backend name (``backend="fa3"``)."""
    load: Callable[[], Api]
    """Imports the library; raises ``Unavailable`` with the reason in a few words when it cannot."""
    min_capability: tuple[int, int] | None
    """The CUDA compute capability it needs, or newer; None: any device (no CUDA needed)."""
    dtypes: tuple[torch.dtype, ...] | None
    """The input dtypes it takes; None: any."""
    head_dims: Callable[[tuple[int, int] | None, int], bool]
    """Whether it takes a head dim (padded to a multiple of 8) on a device of that compute capability."""
    kinds: frozenset[str]
    """The layer kinds (``KINDS``) flashcp passes to it."""
    kinds_declared: bool
    """Whether it runs one of ``kinds`` only when its forward and backward entry points declare the parameter
    (``window_size``/``window_size_left``, ``softcap``): releases differ."""
    withheld: tuple[tuple[str, str], ...] = ()
    """``(kind, why)`` for a kind this library declares but flashcp does not pass to it (a backward that
    ignores it, say): the reason a request for it is refused with."""
    auto_majors: tuple[int, int | None] | None
    """The compute capability majors on which ``"auto"`` tries it, first and last (None: every newer one);
    None: ``"auto"`` does not try it (the reference kernel, its last resort)."""
    attention: Callable
    """The differentiable attention (see the class docstring)."""
    forward: Callable
    """The forward returning the log-sum-exp (see the class docstring)."""
    backward: Callable
    """The block-wise backward (see the class docstring)."""


# ---------------------------------------------------------------- importing a library

def import_module(module: str, package: str):
    """``module`` imported; ``Unavailable`` saying whether ``package`` is missing or fails to import."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
            raise Unavailable(f"{package} is not installed", installed=False) from None
        raise Unavailable(f"{module} is installed but does not import ({type(e).__name__}: {e})",
                          installed=True) from None
    except Exception as e:  # noqa: BLE001 - a wheel for another torch or CUDA: undefined symbol, OSError, ...
        raise Unavailable(f"{module} is installed but does not import ({type(e).__name__}: {e})",
                          installed=True) from None


def attribute(module, name: str):
    """``module.name``; ``Unavailable`` (an unsupported release) when it has none."""
    value = getattr(module, name, None)
    if value is None:
        raise Unavailable(f"{module.__name__} has no {name} (an unsupported release)", installed=True)
    return value


def version_of(text: str) -> tuple[int, ...]:
    """``(major, minor, patch)`` of a version string, as far as it has them."""
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def up_to_256(capability: tuple[int, int] | None, head_dim: int) -> bool:
    """The head-dim rule of most kernels: up to 256."""
    return head_dim <= 256


# ---------------------------------------------------------------- calling a library entry point

@functools.cache
def parameters(fn) -> dict[str, bool]:
    """Parameter name -> whether it is required, as ``fn`` declares them.

    ``torch.library.custom_op`` functions (flash-attn 2.7+, FA3) and torch ops carry their parameters in the
    op schema; their Python signature is only ``(*args, **kwargs)``.
    """
    op = getattr(fn, "_opoverload", fn)
    if isinstance(op, torch._ops.OpOverloadPacket):
        op = op.default
    schema = getattr(op, "_schema", None)
    if isinstance(schema, torch._C.FunctionSchema):
        return {a.name: not a.has_default_value() for a in schema.arguments}
    params = inspect.signature(fn).parameters.values()
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        raise BackendUnavailableError(f"{getattr(fn, '__qualname__', fn)} declares no parameter names flashcp "
                                      f"can read ({inspect.signature(fn)})")
    return {p.name: p.default is p.empty for p in params}


def declares(fn, *names: str) -> bool:
    """Whether ``fn`` declares one of ``names`` (False when its parameters cannot be read)."""
    try:
        return any(name in parameters(fn) for name in names)
    except BackendUnavailableError:
        return False


def call(fn, leading: list, known: dict[str, Any]):
    """``fn(*leading, **the known arguments it declares)``; BackendUnavailableError if it needs others."""
    rest = dict(list(parameters(fn).items())[len(leading):])
    missing = [name for name, required in rest.items() if required and name not in known]
    if missing:
        raise BackendUnavailableError(f"{getattr(fn, '__qualname__', fn)} needs arguments flashcp does not "
                                      f"know: {', '.join(missing)}")
    return fn(*leading, **{name: known[name] for name in rest if name in known})


# ---------------------------------------------------------------- chunks as plain causal sequences

def chunk_segments(num_q: np.ndarray, num_k: np.ndarray, first_key: np.ndarray,
                   chunk: int) -> tuple[np.ndarray, ...]:
    """Split bottom-right causal sequences at chunk boundaries into plain causal sequences (host, int64).

    Sequence ``i`` has ``num_k[i]`` keys at the document positions ``first_key[i], first_key[i] + 1, ...`` and
    ``num_q[i]`` queries at the last ``num_q[i]`` of them. Under chunked attention a query at position p sees
    the keys ``[K*floor(p/K), p]``: the queries of one chunk with the keys of that chunk up to the last of them
    are a bottom-right causal sequence of their own. No padding: the pieces' queries tile the sequence's.

    Returns ``(sequence, q_len, k_len, k_skip)`` per piece, in order: its sequence, queries, keys, and the
    sequence's keys before the piece's first key (keys of earlier chunks no query of the piece sees).
    """
    num_q, num_k, first_key = (np.asarray(x, dtype=np.int64) for x in (num_q, num_k, first_key))
    last = first_key + num_k
    first_query = last - num_q
    first_chunk = first_query // chunk
    count = np.where(num_q > 0, (last - 1) // chunk - first_chunk + 1, 0)
    sequence = np.repeat(np.arange(num_q.size), count)
    within = np.arange(sequence.size) - np.repeat(np.cumsum(count) - count, count)
    boundary = (first_chunk[sequence] + within) * chunk
    stop = np.minimum(boundary + chunk, last[sequence])
    key_from = np.maximum(boundary, first_key[sequence])
    return sequence, stop - np.maximum(boundary, first_query[sequence]), stop - key_from, \
        key_from - first_key[sequence]


# ---------------------------------------------------------------- padded head dims and scales

def padded_head_dim(head_dim: int) -> int:
    """``head_dim`` rounded up to a multiple of 8, what the GPU kernels require."""
    return -(-head_dim // 8) * 8


def _pad(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``x`` with its last dim zero-padded to ``head_dim`` (the same tensor when it already has it)."""
    return x if x.shape[-1] == head_dim else F.pad(x, (0, head_dim - x.shape[-1]))


def fold_softmax_scale(q_THD: torch.Tensor, softmax_scale: float | None) -> torch.Tensor:
    """``q`` scaled so that a kernel's default ``1 / sqrt(D)`` gives ``softmax_scale`` (None: unchanged)."""
    if softmax_scale is None:
        return q_THD
    return q_THD * (softmax_scale * math.sqrt(q_THD.shape[-1]))


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of log-sum-exps and partial-output merges for inputs of ``dtype``: float32 or wider."""
    return torch.promote_types(dtype, torch.float32)


def pad_attention(attend: Callable) -> Callable:
    """The record's ``attention`` from ``attend(api, q_TPH, k_SKP, v_SKP, cu_q, cu_k, max_q, max_k, scale)``.

    Head dims that are not a multiple of 8 are zero-padded to one, as flash-attn's own Python wrapper does;
    the scale stays ``1/sqrt(D)`` of the real D.
    """
    def attention(api, q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  softmax_scale):
        head_dim = q_THD.shape[-1]
        scale = head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)
        padded = padded_head_dim(head_dim)
        q_TPH, k_SKP, v_SKP = (_pad(x, padded) for x in (q_THD, k_SKD, v_SKD))
        out = attend(api, q_TPH, k_SKP, v_SKP, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)
        return out if padded == head_dim else out[..., :head_dim]

    return attention


def pad_forward(name: str, forward: Callable) -> Callable:
    """The record's ``forward`` around a library's forward on padded head dims.

    ``forward(api, q_TPH, k_SKP, v_SKP, cu_q, cu_k, max_q, max_k, causal, scale, left, softcap) -> (out_TPH,
    lse_HT)``; ``left``: the window's keys before the diagonal (-1: no window); ``softcap``: None or c.
    """
    def forward_lse(api, q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                    window, chunk, softcap):
        num_tokens, num_heads, head_dim = q_THD.shape
        left = -1 if window is None else window - 1
        padded = padded_head_dim(head_dim)
        q_TPH, k_SKP, v_SKP = (_pad(x, padded) for x in (q_THD, k_SKD, v_SKD))
        with torch.no_grad():
            out, lse = forward(api, q_TPH, k_SKP, v_SKP, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal, head_dim ** -0.5, left, softcap)
        out = out if padded == head_dim else out[..., :head_dim]
        # every supported release returns the varlen log-sum-exp packed, (H, T) float32
        if lse.shape != (num_heads, num_tokens):
            raise BackendUnavailableError(f"attention backend '{name}' returned a log-sum-exp of shape "
                                          f"{tuple(lse.shape)}, not the packed (H, T) = ({num_heads}, "
                                          f"{num_tokens}) that block-wise attention needs; upgrade it")
        return out, lse.transpose(0, 1)

    return forward_lse


def pad_backward(backward: Callable) -> Callable:
    """The record's ``backward`` around a library's backward on padded head dims.

    ``backward(api, dout, q, k, v, out, lse_HT, cu_q, cu_k, max_q, max_k, causal, scale, left, softcap) ->
    (dq, dk, dv)`` on padded, contiguous tensors; ``lse_HT`` float32; ``softcap`` 0.0: none.
    """
    def backward_blocks(api, grad_out_THD, q_THD, k_SKD, v_SKD, out_THD, lse_TH, cu_seqlens_q, cu_seqlens_k,
                        max_seqlen_q, max_seqlen_k, causal, window, chunk, softcap):
        head_dim = q_THD.shape[-1]
        padded = padded_head_dim(head_dim)
        dout, q, k, v, out = (_pad(x, padded).contiguous() for x in (grad_out_THD, q_THD, k_SKD, v_SKD, out_THD))
        lse_HT = lse_TH.transpose(0, 1).float().contiguous()
        dq, dk, dv = backward(api, dout, q, k, v, out, lse_HT, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, causal, head_dim ** -0.5, -1 if window is None else window - 1,
                              0.0 if softcap is None else float(softcap))
        if padded != head_dim:
            dq, dk, dv = (x[..., :head_dim] for x in (dq, dk, dv))
        return dq, dk, dv

    return backward_blocks


# ---------------------------------------------------------------- calls flash-attn's releases share

def flash_attention(api: Api, q_TPH, k_SKP, v_SKP, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    scale: float) -> torch.Tensor:
    """FA2, FA3 and FA4's differentiable ``flash_attn_varlen_func``, bottom-right causal; ``out_TPH``."""
    # keywords: FA4 takes qv as its fourth positional argument
    out = api.attention(q_TPH, k_SKP, v_SKP, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=scale, causal=True)
    return out[0] if isinstance(out, tuple) else out  # FA4 returns (out, lse)


def probs_forward(name: str) -> Callable:
    """FA2 and FA3's forward with the log-sum-exp: ``flash_attn_varlen_func(..., return_attn_probs=True)``.

    The differentiable function returns the log-sum-exp when asked (``Api.forward`` is that same function).
    """
    def forward(api: Api, q_TPH, k_SKP, v_SKP, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                scale, left, softcap):
        options: dict[str, Any] = {} if softcap is None else {"softcap": float(softcap)}
        if left >= 0:
            options["window_size"] = (left, 0)
        result = api.attention(q_TPH, k_SKP, v_SKP, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                               max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=scale,
                               causal=causal, return_attn_probs=True, **options)
        if not isinstance(result, tuple):  # FA3 builds of mid-2025 ignore return_attn_probs
            raise BackendUnavailableError(f"attention backend '{name}' returned no log-sum-exp; "
                                          f"block-wise attention needs a newer build")
        return result[0], result[1]

    return forward
