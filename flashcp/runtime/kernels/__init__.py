"""Variable-length causal attention kernels: FA3, FA4, FA2 (``flash_attn``), ``torch_varlen`` and ``reference``.

This package is the only place that imports flash-attention (lazily, on first use; each library's module
imports its own). Every backend computes the same thing: for each sequence ``i`` of a packed batch, the queries
``q[cu_q[i]:cu_q[i+1]]`` attend to the keys ``k[cu_k[i]:cu_k[i+1]]`` with a *bottom-right aligned* causal mask.
A query shard ``[start, start+n)`` of a document therefore attends to the key prefix ``[0, start+n)``: query
``j`` sees keys ``0 .. start+j``. Every sequence needs at least as many keys as queries.

Backends (``BACKENDS``), one ``Library`` record each (``library.py``: how it loads, what it needs, its entry
points), in ``LIBRARIES``; a new library is one module with its record, one entry there, and one fake in
``tests/fake_kernels.py``:

- ``fa3`` (``fa3.py``): FlashAttention-3, ``flash_attn_interface`` built from flash-attention's ``hopper/``;
- ``fa4`` (``fa4.py``): FlashAttention-4, ``flash_attn.cute`` (the ``flash-attn-4`` package), compute
  capability 9.0+;
- ``flash_attn`` (``fa2.py``): FlashAttention-2, ``flash_attn.flash_attn_varlen_func`` (``flash-attn`` 2.6 or
  newer for block-wise attention);
- ``torch_varlen`` (``torch_varlen.py``): ``torch.nn.attention.varlen.varlen_attn`` and its ``torch_attn`` ops;
- ``reference`` (``reference.py``): ``scaled_dot_product_attention`` per sequence; any device and dtype
  (float64 included).

A backend is *available* for some tensors when its package imports (an installed package that fails to import,
for instance a wheel built for another torch, is unavailable with that reason), the tensors are on a CUDA
device of a compute capability it supports, in float16 or bfloat16, with a head dim it handles. Head dims
that are not a multiple of 8 are zero-padded to one, as flash-attn's own Python wrapper does (the kernels
require it; the scale stays ``1/sqrt(D)`` of the real D). ``"auto"`` takes, on Hopper and newer, FA3 (9.x
only) and FA4 when installed, then FA2, then torch_varlen; below Hopper FA2, then torch_varlen (the table's
order, each library on the compute capabilities its ``auto_majors`` name). It warns once
(``BackendFallbackWarning``) when it skips an installed backend, and when no GPU kernel can run CUDA tensors
(float32, say) and it must use the reference kernel, which loops over sequences in Python with a host sync
per call. Requested by name, an unavailable backend raises ``BackendUnavailableError`` with the
reason in one sentence. ``_device_capability`` is the one place that looks at the device.

Layer kinds (``flashcp.runtime.layer_kinds``) run through the log-sum-exp entry points below, which take a
sliding ``window``, a ``chunk`` and a logit ``softcap``: the reference kernel runs all three; FA2 (2.6+), FA3,
FA4 and ``torch_varlen`` a window, which their forward and backward entry points declare (``window_size`` or
``window_size_left/right``); FA2 (2.6+) and FA3 a soft-cap (``softcap``, which their forward and backward
take; FA4's backward declares one but ignores it, so flashcp does not pass it to FA4). No backward entry
point flashcp calls takes a chunk (FA3's ``attention_chunk`` is a forward argument), so every backend but
the reference runs a chunk as plain causal sequences split at chunk boundaries (``library.chunk_segments``:
each chunk's queries with that chunk's keys up to the last of them; no padding), forward and backward, with
the log-sum-exp. For a kind a backend cannot run, ``auto``
falls back with its one warning and a backend asked for by name says why.

Block-wise attention (the ``ring`` comm mode) needs two more entry points, not differentiable themselves:
``varlen_attention_forward`` returns the output *and* its log-sum-exp, and may drop the causal mask (a query
attends to every key of its sequence); ``varlen_attention_backward`` computes dq, dk, dv of one block from
the *merged* output and log-sum-exp of all blocks, so that per-block gradients add up to the exact gradient
(``P = exp(S - lse)``, ``dS = P * (dO V^T - rowsum(dO * O))``). They call each library's backward entry
point (FA2 ``_flash_attn_varlen_backward``, FA3 ``_flash_attn_backward``, FA4 ``_flash_attn_bwd``, torch's
``torch_attn::_varlen_attn_backward``) by the parameter names it declares: its op schema when it is a torch
op or a ``torch.library.custom_op`` (whose Python signature is only ``(*args, **kwargs)``), else its Python
signature. They need the packed ``(H, T)`` log-sum-exp: flash-attn 2.5 and older return a padded
``(B, H, max_seqlen)`` one, so ``auto`` passes over them for block-wise attention. The reference backend
uses, on CPU in float32/float64, the CPU flash-attention ops that ``scaled_dot_product_attention`` itself runs
there (they return and take the log-sum-exp; exact in float64), and elsewhere the same formulas written out
in PyTorch.

Shape legend: ``T`` packed query tokens, ``S`` packed key tokens, ``H`` query heads, ``K`` key/value heads
(``H % K == 0``; grouped-query attention when ``K < H``), ``D`` head dim, ``P`` head dim padded to a multiple
of 8, ``B`` sequences in the batch.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch

from flashcp.runtime.kernels.fa2 import FLASH_ATTN
from flashcp.runtime.kernels.fa3 import FA3
from flashcp.runtime.kernels.fa4 import FA4
from flashcp.runtime.kernels.library import (
    HALF_DTYPES,
    KINDS,
    Api,
    BackendFallbackWarning,
    BackendUnavailableError,
    Library,
    Unavailable,
    chunk_segments,
    declares,
    fold_softmax_scale,
    lse_dtype,
    padded_head_dim,
)
from flashcp.runtime.kernels.reference import REFERENCE
from flashcp.runtime.kernels.torch_varlen import TORCH_VARLEN

__all__ = ["BACKENDS", "GPU_BACKENDS", "LIBRARIES", "BackendFallbackWarning", "BackendUnavailableError",
           "backend_available", "fold_softmax_scale", "lse_dtype", "resolve_backend", "unavailable_reason",
           "varlen_attention", "varlen_attention_backward", "varlen_attention_forward"]

LIBRARIES: dict[str, Library] = {library.name: library for library in (FA3, FA4, FLASH_ATTN, TORCH_VARLEN, REFERENCE)}
"""Every kernel backend by name, best first: ``"auto"`` tries the GPU ones in this order (each on the compute
capabilities its ``auto_majors`` name) and falls back to the reference kernel."""
BACKENDS = tuple(LIBRARIES)
"""Every kernel backend; ``"auto"`` tries the GPU ones in the order ``_auto_order`` gives for the device."""
GPU_BACKENDS = tuple(name for name, library in LIBRARIES.items() if library.min_capability is not None)
"""The backends that run on CUDA devices only."""


def _device_capability(device: torch.device) -> tuple[int, int] | None:
    """``(major, minor)`` compute capability of a CUDA device; None for every other device."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


@functools.cache
def _load(backend: str) -> Api | Unavailable:
    try:
        return LIBRARIES[backend].load()
    except Unavailable as e:
        return e


def _api(backend: str) -> Api:
    api = _load(backend)
    assert isinstance(api, Api), api
    return api


# ---------------------------------------------------------------- choosing a backend

def _auto_order(capability: tuple[int, int]) -> tuple[str, ...]:
    """GPU backends ``"auto"`` tries on a device of this compute capability, best first."""
    return tuple(library.name for library in LIBRARIES.values() if library.auto_majors is not None
                 and library.auto_majors[0] <= capability[0]
                 and (library.auto_majors[1] is None or capability[0] <= library.auto_majors[1]))


# the parameter names that say an entry point takes a kind; why a library does not run one flashcp does not pass
_KIND_PARAMETERS = {"window": ("window_size", "window_size_left"), "softcap": ("softcap",)}
_NOT_PASSED = {"window": "flashcp does not pass a sliding window (window={value}) to {name}",
               "softcap": "flashcp does not pass logit soft-capping (softcap={value}) to {name}"}
_NOT_DECLARED = {"window": "{name} takes no sliding window (window={value}) in this release",
                 "softcap": "{name} takes no logit soft-capping (softcap={value})"}


def _kind_problem(library: Library, api: Api, kind: dict[str, int | float | None]) -> str | None:
    """Why ``library`` cannot run the window or soft-cap of ``kind``, or None (every library runs chunks)."""
    for name in KINDS:
        value = kind.get(name)
        if value is None or name == "chunk":  # split into plain causal sequences where not native
            continue
        if name not in library.kinds:
            why = dict(library.withheld).get(name)
            return _NOT_PASSED[name].format(name=library.name, value=value) + (f": {why}" if why else "")
        if library.kinds_declared and not (declares(api.forward, *_KIND_PARAMETERS[name])
                                           and declares(api.backward, *_KIND_PARAMETERS[name])):
            return _NOT_DECLARED[name].format(name=library.name, value=value)
    return None


def _why_unavailable(backend: str, q: torch.Tensor, blockwise: bool = False, *, window: int | None = None,
                     chunk: int | None = None, softcap: float | None = None) -> str | None:
    """None when ``backend`` can run on tensors like ``q`` (and the layer kind asked for), else the reason."""
    library = LIBRARIES.get(backend)
    if library is None:
        return f"unknown backend '{backend}' (choose from {', '.join(BACKENDS)} or auto)"
    capability = _device_capability(q.device)
    if library.min_capability is not None and capability is None:
        return f"{backend} needs CUDA tensors, got {q.device.type}"
    if library.dtypes is not None and q.dtype not in library.dtypes:
        need = " or ".join(str(dtype).removeprefix("torch.") for dtype in library.dtypes)
        return f"{backend} needs {need}, got {q.dtype}"
    api = _load(backend)
    if isinstance(api, Unavailable):
        return str(api)
    if library.min_capability is not None and capability is not None and capability < library.min_capability:
        need = ".".join(map(str, library.min_capability))
        return f"{backend} needs compute capability {need} or newer, the device has {capability[0]}.{capability[1]}"
    if not library.head_dims(capability, padded_head_dim(q.shape[-1])):
        device = "this device" if capability is None else f"compute capability {capability[0]}.x"
        return f"{backend} does not support head dim {q.shape[-1]} on {device}"
    kind = {"window": window, "chunk": chunk, "softcap": softcap}
    kinds = any(value is not None for value in kind.values())
    if (blockwise or kinds) and api.why_not_blockwise is not None:
        return api.why_not_blockwise
    return _kind_problem(library, api, kind) if kinds else None


def unavailable_reason(backend: str, q: torch.Tensor, blockwise: bool = False, **kind) -> str | None:
    """Why ``backend`` cannot run on tensors like ``q``, in a few words; None when it can.

    ``blockwise``: the ring's entry points too; ``kind``: ``window``, ``chunk``, ``softcap`` the layer needs.
    The words are those ``resolve_backend`` says.
    """
    return _why_unavailable(backend, q, blockwise, **kind)


def backend_available(backend: str, q: torch.Tensor, blockwise: bool = False, **kind) -> bool:
    """Whether ``backend`` can run on tensors like ``q`` (device, dtype, head dim, installed packages).

    ``blockwise``: also the log-sum-exp entry points of the ``ring`` comm mode; ``kind``: ``window``,
    ``chunk``, ``softcap`` (``varlen_attention_forward``) the layer needs.
    """
    return _why_unavailable(backend, q, blockwise, **kind) is None


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, BackendFallbackWarning, stacklevel=3)


def resolve_backend(backend: str, q: torch.Tensor, blockwise: bool = False, **kind) -> str:
    """The concrete backend for ``backend`` on tensors like ``q`` (``"auto"``: see the package docstring).

    ``blockwise``: the backend must also run ``varlen_attention_forward/backward`` (the ``ring`` comm mode).
    ``kind``: the layer's ``window``, ``chunk`` and ``softcap`` (None: not used), which the backend must run
    too. Raises BackendUnavailableError naming the reason when an explicitly requested backend cannot run.
    """
    if backend != "auto":
        why = _why_unavailable(backend, q, blockwise, **kind)
        if why is not None:
            raise BackendUnavailableError(f"attention backend '{backend}' cannot run here: {why}")
        return backend
    capability = _device_capability(q.device)
    if capability is None:
        return "reference"
    skipped: list[str] = []
    for name in _auto_order(capability):
        why = _why_unavailable(name, q, blockwise, **kind)
        if why is None:
            if skipped:
                _warn_once(f"attention backend auto skipped {'; '.join(skipped)}; using {name}")
            return name
        api = _load(name)
        if not (isinstance(api, Unavailable) and not api.installed):
            skipped.append(why if why.startswith(name) else f"{name} ({why})")
    asked = [f"{name}={value}" for name, value in kind.items() if value is not None]
    what = f" and {', '.join(asked)}" if asked else ""
    hint = ("the GPU kernels run windows and chunks, and FA2 and FA3 soft-caps" if asked and q.dtype in HALF_DTYPES else
            "train in bfloat16 or float16 to use the GPU kernels")
    _warn_once(f"attention backend auto found no GPU kernel for {q.dtype} tensors with head dim {q.shape[-1]}{what} "
               f"on {q.device} ({'; '.join(skipped) or 'none is installed'}): running the reference kernel, a Python "
               f"loop with a host sync per call ({hint})")
    return "reference"


# ---------------------------------------------------------------- the entry points

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
    return LIBRARIES[backend].attention(_api(backend), q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k,
                                        max_seqlen_q, max_seqlen_k, softmax_scale)


def varlen_attention_forward(q_THD: torch.Tensor, k_SKD: torch.Tensor, v_SKD: torch.Tensor,
                             cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                             max_seqlen_k: int, causal: bool, backend: str = "auto", *, window: int | None = None,
                             chunk: int | None = None, softcap: float | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen attention returning ``(out_THD, lse_TH)``; not differentiable (for use in autograd Functions).

    Args: as ``varlen_attention``, plus ``causal``: True for the bottom-right causal mask (every sequence
    then needs at least as many keys as queries), False to let each query see every key of its sequence;
    and the layer kind, which needs ``causal`` and each sequence's keys to be a document's prefix from its
    first token (key ``i`` is the document's position ``i``; query ``j`` its position ``S_i - T_i + j``):
    ``window`` W: a query at position p sees keys ``(p - W, p]``; ``chunk`` K: keys ``[K*floor(p/K), p]``;
    ``softcap`` c: scores ``c * tanh(s / c)`` (s already scaled) before the mask.

    ``lse_TH`` is ``log(sum_j exp(s_j))`` over the keys each query sees, ``s_j = q . k_j / sqrt(D)`` (soft-
    capped when asked), (T, H), in ``lse_dtype(q.dtype)``. Every sequence must have at least one key.
    """
    backend = resolve_backend(backend, q_THD, blockwise=True, window=window, chunk=chunk, softcap=softcap)
    num_tokens, num_heads, _ = q_THD.shape
    if num_tokens == 0:
        return q_THD.clone(), q_THD.new_zeros((0, num_heads), dtype=lse_dtype(q_THD.dtype))
    library = LIBRARIES[backend]
    if chunk is not None and "chunk" not in library.kinds:
        split = _ChunkSplit(cu_seqlens_q, cu_seqlens_k, chunk, causal)
        return library.forward(_api(backend), q_THD, split.keys(k_SKD), split.keys(v_SKD), *split.lengths, causal,
                               window, None, softcap)
    return library.forward(_api(backend), q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, causal, window, chunk, softcap)


def varlen_attention_backward(grad_out_THD: torch.Tensor, q_THD: torch.Tensor, k_SKD: torch.Tensor,
                              v_SKD: torch.Tensor, out_THD: torch.Tensor, lse_TH: torch.Tensor,
                              cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                              max_seqlen_k: int, causal: bool, backend: str = "auto", *, window: int | None = None,
                              chunk: int | None = None, softcap: float | None = None
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
        window: the sliding window the forward call used (``varlen_attention_forward``), or None.
        chunk: the chunk length the forward call used, or None.
        softcap: the logit soft-cap the forward call used, or None.

    The gradients are in the inputs' dtypes; summed over the blocks they are the exact gradient of the
    attention over all blocks.
    """
    backend = resolve_backend(backend, q_THD, blockwise=True, window=window, chunk=chunk, softcap=softcap)
    if q_THD.shape[0] == 0:
        return q_THD.clone(), torch.zeros_like(k_SKD), torch.zeros_like(v_SKD)
    library = LIBRARIES[backend]
    if chunk is not None and "chunk" not in library.kinds:
        split = _ChunkSplit(cu_seqlens_q, cu_seqlens_k, chunk, causal)
        dq, dk, dv = library.backward(_api(backend), grad_out_THD, q_THD, split.keys(k_SKD), split.keys(v_SKD),
                                      out_THD, lse_TH, *split.lengths, causal, window, None, softcap)
        return dq, split.key_grad(dk, k_SKD), split.key_grad(dv, v_SKD)
    return library.backward(_api(backend), grad_out_THD, q_THD, k_SKD, v_SKD, out_THD, lse_TH, cu_seqlens_q,
                            cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, chunk, softcap)


class _ChunkSplit:
    """Causal sequences split at chunk boundaries (``library.chunk_segments``), for a library without chunks.

    Reads ``cu_seqlens`` on the host (one sync per call; ``cp_attention`` needs none: its metas are split
    already). Keys of a sequence's chunks before its first query are no piece's: they are left out of the
    call (a gather) and their gradient is zero.
    """

    def __init__(self, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, chunk: int, causal: bool):
        if not causal:
            raise ValueError("chunked attention needs the causal mask (causal=True)")
        cu_q, cu_k = cu_seqlens_q.cpu().numpy().astype(np.int64), cu_seqlens_k.cpu().numpy().astype(np.int64)
        num_k = np.diff(cu_k)
        sequence, q_len, k_len, k_skip = chunk_segments(np.diff(cu_q), num_k, np.zeros_like(num_k), chunk)
        device = cu_seqlens_q.device
        self.lengths = (torch.from_numpy(np.r_[0, np.cumsum(q_len)].astype(np.int32)).to(device),
                        torch.from_numpy(np.r_[0, np.cumsum(k_len)].astype(np.int32)).to(device),
                        int(q_len.max(initial=0)), int(k_len.max(initial=0)))
        self.index = None
        if k_len.sum() != cu_k[-1]:  # pieces are in order and disjoint: equal totals mean every key is used
            starts = cu_k[:-1][sequence] + k_skip
            index = np.repeat(starts - (np.cumsum(k_len) - k_len), k_len) + np.arange(int(k_len.sum()))
            self.index = torch.from_numpy(index).to(device)

    def keys(self, x_SKD: torch.Tensor) -> torch.Tensor:
        """The keys (or values) the pieces read, in piece order."""
        return x_SKD if self.index is None else x_SKD.index_select(0, self.index)

    def key_grad(self, grad: torch.Tensor, like_SKD: torch.Tensor) -> torch.Tensor:
        """The pieces' key (or value) gradient put back on all keys, zero where no piece reads."""
        return grad if self.index is None else torch.zeros_like(like_SKD).index_copy_(0, self.index, grad)
