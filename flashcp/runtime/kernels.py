"""Variable-length causal attention kernels: FA3, FA4, FA2 (``flash_attn``), ``torch_varlen`` and ``reference``.

This is the only module that imports flash-attention (lazily, on first use). Every backend computes the same
thing: for each sequence ``i`` of a packed batch, the queries ``q[cu_q[i]:cu_q[i+1]]`` attend to the keys
``k[cu_k[i]:cu_k[i+1]]`` with a *bottom-right aligned* causal mask. A query shard ``[start, start+n)`` of a
document therefore attends to the key prefix ``[0, start+n)``: query ``j`` sees keys ``0 .. start+j``. Every
sequence needs at least as many keys as queries.

Backends (``BACKENDS``):

- ``fa3``: FlashAttention-3, ``flash_attn_interface`` built from flash-attention's ``hopper/`` folder;
- ``fa4``: FlashAttention-4, ``flash_attn.cute`` (the ``flash-attn-4`` package), compute capability 9.0+;
- ``flash_attn``: FlashAttention-2, ``flash_attn.flash_attn_varlen_func`` (``flash-attn`` 2.6 or newer for
  block-wise attention);
- ``torch_varlen``: ``torch.nn.attention.varlen.varlen_attn`` and its ``torch_attn`` ops;
- ``reference``: ``scaled_dot_product_attention`` per sequence; any device and dtype (float64 included).

A backend is *available* for some tensors when its package imports (an installed package that fails to import,
for instance a wheel built for another torch, is unavailable with that reason), the tensors are on a CUDA
device of a compute capability it supports, in float16 or bfloat16, with a head dim it handles. Head dims
that are not a multiple of 8 are zero-padded to one, as flash-attn's own Python wrapper does (the kernels
require it; the scale stays ``1/sqrt(D)`` of the real D). ``"auto"`` takes, on Hopper and newer, FA3 (9.x
only) and FA4 when installed, then FA2, then torch_varlen; below Hopper FA2, then torch_varlen. It warns
once (``BackendFallbackWarning``) when it skips an installed backend, and when no GPU kernel can run CUDA
tensors (float32, say) and it must use the reference kernel, which loops over sequences in Python with a
host sync per call. Requested by name, an unavailable backend raises ``BackendUnavailableError`` with the
reason in one sentence. ``_device_capability`` is the one place that looks at the device.

Layer kinds (``flashcp.runtime.layer_kinds``) run through the log-sum-exp entry points below, which take a
sliding ``window``, a ``chunk`` and a logit ``softcap``: the reference kernel runs all three; FA2 (2.6+), FA3,
FA4 and ``torch_varlen`` a window, which their forward and backward entry points declare (``window_size`` or
``window_size_left/right``); FA2 (2.6+) a soft-cap (``softcap``; FA3 and FA4 declare one too, but flashcp
does not pass it to them yet). No backward entry point flashcp calls takes a chunk (FA3's ``attention_chunk``
is a forward argument), so chunks run on the reference kernel. For a kind a backend cannot run, ``auto``
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
import importlib
import inspect
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from flashcp.errors import FlashcpError

__all__ = ["BACKENDS", "GPU_BACKENDS", "BackendFallbackWarning", "BackendUnavailableError", "backend_available",
           "lse_dtype", "resolve_backend", "unavailable_reason", "varlen_attention", "varlen_attention_backward",
           "varlen_attention_forward"]

BACKENDS = ("fa3", "fa4", "flash_attn", "torch_varlen", "reference")
"""Every kernel backend; ``"auto"`` tries the GPU ones in the order ``_auto_order`` gives for the device."""
GPU_BACKENDS = BACKENDS[:-1]
"""The backends that run on CUDA devices only."""

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_MIN_CAPABILITY = {"fa3": (8, 0), "fa4": (9, 0), "flash_attn": (8, 0), "torch_varlen": (8, 0)}
_MAX_HEAD_DIM = 256


class BackendUnavailableError(FlashcpError):
    """The requested attention backend cannot run on these tensors (not installed, wrong device or dtype)."""


class BackendFallbackWarning(UserWarning):
    """``backend="auto"`` skipped an installed backend, or must run the reference kernel on a GPU."""


def _device_capability(device: torch.device) -> tuple[int, int] | None:
    """``(major, minor)`` compute capability of a CUDA device; None for every other device."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


# ---------------------------------------------------------------- importing the libraries

@dataclass(frozen=True, slots=True)
class _Api:
    """What one GPU backend's import provides."""

    forward: Callable
    """The differentiable varlen attention function."""
    backward: Callable | None
    """The block-wise backward entry point (None for torch_varlen, whose ops are looked up apart)."""
    why_not_blockwise: str | None
    """Why this build cannot run block-wise attention, or None."""


class _Unavailable(Exception):
    def __init__(self, reason: str, installed: bool):
        super().__init__(reason)
        self.installed = installed


def _import(module: str, package: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
            raise _Unavailable(f"{package} is not installed", installed=False) from None
        raise _Unavailable(f"{module} is installed but does not import ({type(e).__name__}: {e})",
                           installed=True) from None
    except Exception as e:  # noqa: BLE001 - a wheel for another torch or CUDA: undefined symbol, OSError, ...
        raise _Unavailable(f"{module} is installed but does not import ({type(e).__name__}: {e})",
                           installed=True) from None


def _attribute(module, name: str):
    value = getattr(module, name, None)
    if value is None:
        raise _Unavailable(f"{module.__name__} has no {name} (an unsupported release)", installed=True)
    return value


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _load_flash_attn() -> _Api:
    package = _import("flash_attn", "flash-attn")
    if getattr(package, "__file__", None) is None:  # a namespace package: only flash-attn-4 is installed
        raise _Unavailable("flash-attn (FlashAttention-2) is not installed", installed=False)
    interface = _import("flash_attn.flash_attn_interface", "flash-attn")
    version = str(getattr(package, "__version__", "0"))
    why = None
    if _version(version) < (2, 6):
        why = (f"flash-attn {version} returns the padded (B, H, max_seqlen) log-sum-exp; block-wise attention "
               f"needs 2.6 or newer (pip install -U flash-attn)")
    backward = getattr(interface, "_flash_attn_varlen_backward", None)
    if backward is None and why is None:
        why = f"flash-attn {version} has no flash_attn_interface._flash_attn_varlen_backward"
    return _Api(forward=_attribute(package, "flash_attn_varlen_func"), backward=backward, why_not_blockwise=why)


def _load_fa3() -> _Api:
    interface = _import("flash_attn_interface", "FlashAttention-3 (built from flash-attention's hopper/)")
    backward = getattr(interface, "_flash_attn_backward", None)
    return _Api(forward=_attribute(interface, "flash_attn_varlen_func"), backward=backward,
                why_not_blockwise=None if backward is not None else "flash_attn_interface has no _flash_attn_backward")


def _load_fa4() -> _Api:
    cute = _import("flash_attn.cute", "flash-attn-4")
    interface = _import("flash_attn.cute.interface", "flash-attn-4")
    backward = getattr(interface, "_flash_attn_bwd", None)
    return _Api(forward=_attribute(cute, "flash_attn_varlen_func"), backward=backward,
                why_not_blockwise=None if backward is not None else "flash_attn.cute.interface has no _flash_attn_bwd")


def _load_torch_varlen() -> _Api:
    varlen = _import("torch.nn.attention.varlen", f"torch {torch.__version__} varlen attention")
    varlen_attn = _attribute(varlen, "varlen_attn")
    ops = torch.ops.torch_attn
    why = None
    if not (hasattr(ops, "_varlen_attn") and hasattr(ops, "_varlen_attn_backward")):
        why = f"torch {torch.__version__} lacks the torch_attn varlen ops block-wise attention calls"
    params = inspect.signature(varlen_attn).parameters
    # the causal flag moved between torch releases: is_causal=True early, window_size=(-1, 0) later
    if "window_size" not in params and "is_causal" not in params:
        raise _Unavailable(f"torch {torch.__version__} varlen_attn takes neither window_size nor is_causal",
                           installed=True)
    return _Api(forward=varlen_attn, backward=None, why_not_blockwise=why)


_LOADERS = {"fa3": _load_fa3, "fa4": _load_fa4, "flash_attn": _load_flash_attn, "torch_varlen": _load_torch_varlen}


@functools.cache
def _load(backend: str) -> _Api | _Unavailable:
    try:
        return _LOADERS[backend]()
    except _Unavailable as e:
        return e


def _api(backend: str) -> _Api:
    api = _load(backend)
    assert isinstance(api, _Api), api
    return api


# ---------------------------------------------------------------- choosing a backend

def _auto_order(capability: tuple[int, int]) -> tuple[str, ...]:
    """GPU backends ``"auto"`` tries on a device of this compute capability, best first."""
    if capability[0] == 9:
        return ("fa3", "fa4", "flash_attn", "torch_varlen")
    if capability[0] >= 10:
        return ("fa4", "flash_attn", "torch_varlen")
    return ("flash_attn", "torch_varlen")


def _padded_head_dim(head_dim: int) -> int:
    return -(-head_dim // 8) * 8


def _max_head_dim(backend: str, capability: tuple[int, int], head_dim: int) -> bool:
    padded = _padded_head_dim(head_dim)
    if backend == "fa4" and capability[0] in (10, 11):  # FA4 on Blackwell: up to 128, or exactly 256
        return padded <= 128 or padded == 256
    return padded <= _MAX_HEAD_DIM


def _why_unavailable(backend: str, q: torch.Tensor, blockwise: bool = False, *, window: int | None = None,
                     chunk: int | None = None, softcap: float | None = None) -> str | None:
    """None when ``backend`` can run on tensors like ``q`` (and the layer kind asked for), else the reason."""
    if backend == "reference":
        return None
    if backend not in BACKENDS:
        return f"unknown backend '{backend}' (choose from {', '.join(BACKENDS)} or auto)"
    capability = _device_capability(q.device)
    if capability is None:
        return f"{backend} needs CUDA tensors, got {q.device.type}"
    if q.dtype not in _HALF_DTYPES:
        return f"{backend} needs float16 or bfloat16, got {q.dtype}"
    api = _load(backend)
    if isinstance(api, _Unavailable):
        return str(api)
    if capability < _MIN_CAPABILITY[backend]:
        need = ".".join(map(str, _MIN_CAPABILITY[backend]))
        return f"{backend} needs compute capability {need} or newer, the device has {capability[0]}.{capability[1]}"
    if not _max_head_dim(backend, capability, q.shape[-1]):
        return f"{backend} does not support head dim {q.shape[-1]} on compute capability {capability[0]}.x"
    kinds = window is not None or chunk is not None or softcap is not None
    if (blockwise or kinds) and api.why_not_blockwise is not None:
        return api.why_not_blockwise
    return _kind_problem(backend, api, window, chunk, softcap) if kinds else None


def _declares(fn, *names: str) -> bool:
    try:
        return any(name in _parameters(fn) for name in names)
    except BackendUnavailableError:
        return False


def _kind_problem(backend: str, api: _Api, window: int | None, chunk: int | None,
                  softcap: float | None) -> str | None:
    """Why ``backend`` cannot run a window, chunk or soft-cap, from the parameters its entry points declare."""
    if chunk is not None:  # FA3's forward takes attention_chunk, no backward entry point flashcp calls does
        return f"{backend} has no chunked attention (chunk={chunk}) in both its forward and backward"
    forward: Any
    backward: Any
    if backend == "torch_varlen":
        forward, backward = torch.ops.torch_attn._varlen_attn, torch.ops.torch_attn._varlen_attn_backward
    else:
        forward, backward = api.forward, api.backward
    if window is not None and not (_declares(forward, "window_size", "window_size_left")
                                   and _declares(backward, "window_size", "window_size_left")):
        return f"{backend} takes no sliding window (window={window}) in this release"
    if softcap is not None and backend in ("fa3", "fa4"):  # declared, but not emulated by their fakes yet
        return f"flashcp does not pass logit soft-capping (softcap={softcap}) to {backend} yet"
    if softcap is not None and not (_declares(forward, "softcap") and _declares(backward, "softcap")):
        return f"{backend} takes no logit soft-capping (softcap={softcap})"
    return None


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
    """The concrete backend for ``backend`` on tensors like ``q`` (``"auto"``: see the module docstring).

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
        if not (isinstance(api, _Unavailable) and not api.installed):
            skipped.append(why if why.startswith(name) else f"{name} ({why})")
    asked = [f"{name}={value}" for name, value in kind.items() if value is not None]
    what = f" and {', '.join(asked)}" if asked else ""
    hint = ("the GPU kernels run windows, and FA2 soft-caps" if asked and q.dtype in _HALF_DTYPES else
            "train in bfloat16 or float16 to use the GPU kernels")
    _warn_once(f"attention backend auto found no GPU kernel for {q.dtype} tensors with head dim {q.shape[-1]}{what} "
               f"on {q.device} ({'; '.join(skipped) or 'none is installed'}): running the reference kernel, a Python "
               f"loop with a host sync per call ({hint})")
    return "reference"


# ---------------------------------------------------------------- calling a library entry point

@functools.cache
def _parameters(fn) -> dict[str, bool]:
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


def _call(fn, leading: list, known: dict[str, Any]):
    """``fn(*leading, **the known arguments it declares)``; BackendUnavailableError if it needs others."""
    rest = dict(list(_parameters(fn).items())[len(leading):])
    missing = [name for name, required in rest.items() if required and name not in known]
    if missing:
        raise BackendUnavailableError(f"{getattr(fn, '__qualname__', fn)} needs arguments flashcp does not "
                                      f"know: {', '.join(missing)}")
    return fn(*leading, **{name: known[name] for name in rest if name in known})


def _pad(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``x`` with its last dim zero-padded to ``head_dim`` (the same tensor when it already has it)."""
    return x if x.shape[-1] == head_dim else F.pad(x, (0, head_dim - x.shape[-1]))


def fold_softmax_scale(q_THD: torch.Tensor, softmax_scale: float | None) -> torch.Tensor:
    """``q`` scaled so that a kernel's default ``1 / sqrt(D)`` gives ``softmax_scale`` (None: unchanged)."""
    if softmax_scale is None:
        return q_THD
    return q_THD * (softmax_scale * math.sqrt(q_THD.shape[-1]))


# ---------------------------------------------------------------- differentiable attention

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
    if backend == "reference":
        return reference_varlen_attention(q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, softmax_scale)
    head_dim = q_THD.shape[-1]
    scale = head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)
    padded = _padded_head_dim(head_dim)
    q_TPH, k_SKP, v_SKP = (_pad(x, padded) for x in (q_THD, k_SKD, v_SKD))
    lengths = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "max_seqlen_q": max_seqlen_q,
               "max_seqlen_k": max_seqlen_k}
    forward = _api(backend).forward
    if backend == "torch_varlen":
        out = _torch_varlen(forward, q_TPH, k_SKP, v_SKP, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, scale)
    else:  # keywords: FA4 takes qv as its fourth positional argument
        out = forward(q_TPH, k_SKP, v_SKP, **lengths, softmax_scale=scale, causal=True)
        out = out[0] if isinstance(out, tuple) else out  # FA4 returns (out, lse)
    return out if padded == head_dim else out[..., :head_dim]


def _torch_varlen(varlen_attn, q_TPH, k_SKP, v_SKP, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  scale: float) -> torch.Tensor:
    params = _parameters(varlen_attn)
    kwargs: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if k_SKP.shape[1] != q_TPH.shape[1] and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    if "scale" in params:
        kwargs["scale"] = scale
    else:  # releases without a scale argument apply 1/sqrt(P)
        q_TPH = q_TPH * (scale * math.sqrt(q_TPH.shape[-1]))
    return varlen_attn(q_TPH, k_SKP, v_SKP, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)


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


# ---------------------------------------------------------------- block-wise attention (ring)

def _lse_TH(lse: torch.Tensor, num_tokens: int, num_heads: int, backend: str) -> torch.Tensor:
    # every supported release returns the varlen log-sum-exp packed, (H, T) float32
    if lse.shape != (num_heads, num_tokens):
        raise BackendUnavailableError(f"attention backend '{backend}' returned a log-sum-exp of shape "
                                      f"{tuple(lse.shape)}, not the packed (H, T) = ({num_heads}, "
                                      f"{num_tokens}) that block-wise attention needs; upgrade it")
    return lse.transpose(0, 1)


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
    kind = {"window": window, "chunk": chunk, "softcap": softcap}
    backend = resolve_backend(backend, q_THD, blockwise=True, **kind)
    num_tokens, num_heads, head_dim = q_THD.shape
    if num_tokens == 0:
        return q_THD.clone(), q_THD.new_zeros((0, num_heads), dtype=lse_dtype(q_THD.dtype))
    if backend == "reference":
        return _reference_forward(q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, causal, **kind)
    left = -1 if window is None else window - 1
    options: dict[str, Any] = {} if softcap is None else {"softcap": float(softcap)}
    padded = _padded_head_dim(head_dim)
    q_TPH, k_SKP, v_SKP = (_pad(x, padded) for x in (q_THD, k_SKD, v_SKD))
    lengths = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "max_seqlen_q": max_seqlen_q,
               "max_seqlen_k": max_seqlen_k}
    scale = head_dim ** -0.5
    with torch.no_grad():
        if backend == "torch_varlen":
            op = torch.ops.torch_attn._varlen_attn
            out, lse, _ = _call(op, [q_TPH, k_SKP, v_SKP, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k],
                                {"is_causal": causal, "scale": scale,
                                 "window_size": [left, 0] if causal else [-1, -1],
                                 "enable_gqa": k_SKD.shape[1] != num_heads})
        elif backend == "fa4":
            if window is not None:
                options["window_size"] = (left, 0)
            out, lse = _api(backend).forward(q_TPH, k_SKP, v_SKP, **lengths, softmax_scale=scale, causal=causal,
                                             return_lse=True, **options)
        else:
            if window is not None:
                options["window_size"] = (left, 0)
            result = _api(backend).forward(q_TPH, k_SKP, v_SKP, **lengths, softmax_scale=scale, causal=causal,
                                           return_attn_probs=True, **options)
            if not isinstance(result, tuple):  # FA3 builds of mid-2025 ignore return_attn_probs
                raise BackendUnavailableError(f"attention backend '{backend}' returned no log-sum-exp; "
                                              f"block-wise attention needs a newer build")
            out, lse = result[0], result[1]
    out = out if padded == head_dim else out[..., :head_dim]
    return out, _lse_TH(lse, num_tokens, num_heads, backend)


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
    kind = {"window": window, "chunk": chunk, "softcap": softcap}
    backend = resolve_backend(backend, q_THD, blockwise=True, **kind)
    if q_THD.shape[0] == 0:
        return q_THD.clone(), torch.zeros_like(k_SKD), torch.zeros_like(v_SKD)
    if backend == "reference":
        return _reference_backward(grad_out_THD.contiguous(), q_THD, k_SKD, v_SKD, out_THD, lse_TH, cu_seqlens_q,
                                   cu_seqlens_k, causal, **kind)
    head_dim = q_THD.shape[-1]
    padded = _padded_head_dim(head_dim)
    dout, q, k, v, out = (_pad(x, padded).contiguous() for x in (grad_out_THD, q_THD, k_SKD, v_SKD, out_THD))
    lse_HT = lse_TH.transpose(0, 1).float().contiguous()
    dq, dk, dv = _BACKWARDS[backend](dout, q, k, v, out, lse_HT, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, causal, head_dim ** -0.5,
                                     -1 if window is None else window - 1, 0.0 if softcap is None else float(softcap))
    if padded != head_dim:
        dq, dk, dv = (x[..., :head_dim] for x in (dq, dk, dv))
    return dq, dk, dv


def _fa2_backward(dout, q, k, v, out, lse_HT, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                  scale, left, softcap):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # its parameters moved between releases: window_size -> window_size_left/right, softcap, zero_tensors
    _call(_api("flash_attn").backward, [], {
        "dout": dout, "q": q, "k": k, "v": v, "out": out, "softmax_lse": lse_HT, "dq": dq, "dk": dk, "dv": dv,
        "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "max_seqlen_q": max_seqlen_q,
        "max_seqlen_k": max_seqlen_k, "dropout_p": 0.0, "softmax_scale": scale, "causal": causal,
        "window_size": (left, 0) if causal else (-1, -1), "window_size_left": left,
        "window_size_right": 0 if causal else -1, "softcap": softcap, "alibi_slopes": None,
        "deterministic": False, "rng_state": None, "zero_tensors": False})
    return dq, dk, dv


def _fa3_backward(dout, q, k, v, out, lse_HT, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                  scale, left, softcap):
    backward = _api("fa3").backward
    if not {"dq", "dk", "dv"} <= set(_parameters(backward)):
        raise BackendUnavailableError("flash_attn_interface._flash_attn_backward takes no dq, dk, dv buffers")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # the custom op (2025-07 on) says is_causal and window_size_left/right; earlier builds causal, window_size
    _call(backward, [], {
        "dout": dout, "q": q, "k": k, "v": v, "out": out, "softmax_lse": lse_HT, "cu_seqlens_q": cu_seqlens_q,
        "cu_seqlens_k": cu_seqlens_k, "sequed_q": None, "sequed_k": None, "max_seqlen_q": max_seqlen_q,
        "max_seqlen_k": max_seqlen_k, "dq": dq, "dk": dk, "dv": dv, "softmax_scale": scale, "causal": causal,
        "is_causal": causal, "window_size": (left, 0) if causal else (-1, -1), "window_size_left": left,
        "window_size_right": 0 if causal else -1, "softcap": softcap, "deterministic": False, "sm_margin": 0})
    return dq, dk, dv


def _fa4_backward(dout, q, k, v, out, lse_HT, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                  scale, left, softcap):
    # FA4 spells an infinite window None and derives the causal one from ``causal``
    window = {} if left < 0 else {"window_size_left": left, "window_size_right": 0}
    grads = _call(_api("fa4").backward, [], {
        **window, "q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": lse_HT, "softmax_scale": scale,
        "causal": causal, "softcap": softcap, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
        "max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k, "deterministic": False})
    return grads[0], grads[1], grads[2]


def _torch_varlen_backward(dout, q, k, v, out, lse_HT, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           causal, scale, left, softcap):
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout
    return _call(torch.ops.torch_attn._varlen_attn_backward,
                 [dout, q, k, v, out, lse_HT, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                  rng_state], {"scale": scale, "window_size": [left, 0] if causal else [-1, -1]})


_BACKWARDS = {"flash_attn": _fa2_backward, "fa3": _fa3_backward, "fa4": _fa4_backward,
              "torch_varlen": _torch_varlen_backward}


# ---------------------------------------------------------------- the reference kernels

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
