"""Recurrent kernel backends: ``reference`` (``chunked``), ``fla`` and ``mamba_ssm``, behind attention's rules.

This module is the only place that imports flash-linear-attention, mamba_ssm and causal-conv1d (lazily, on
first use). Three operations, each over *segments* of a rank's tokens with a state per segment, as
``chunked``'s kernels take them:

- ``gated_delta``: Gated DeltaNet. ``fla``: ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (varlen through
  ``cu_seqlens`` with one initial state per segment, ``[1, T, H, K]`` layout, returns ``(o, final_state)``
  with the state float32, ``g`` in log space). flashcp normalises and scales q and k itself (``scale=1``,
  ``use_qk_l2norm_in_kernel=False``); fla 0.5.0 and newer take fewer key heads than value heads (GVA),
  older releases get q and k repeated per value head.
- ``ssd``: Mamba-2 SSD. ``mamba_ssm``: ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``. Its
  ``initial_states`` are one per *batch row* (``(batch, H, P, S)``), not per ``seq_idx`` sequence, and its
  per-sequence ``return_varlen_states`` has no backward, so flashcp runs two calls: the segments that start
  from zero and whose final state nobody reads (whole documents) as one row with ``seq_idx``, and the
  *carried* ones (a piece of a cut document: a start state, or a final state the other ranks read) as one
  row each, zero-padded at their end to the longest of them (``dt = 0`` leaves the state as it is), with
  ``initial_states`` and ``return_final_states``. The padding costs ``carried * longest`` tokens of work;
  a rank carries at most the pieces of its cut documents.
- ``conv``: the short causal convolution, run by ``chunked.causal_conv1d`` on one sequence ``[tail 0,
  segment 0, tail 1, ...]``; the libraries' plain causal convolution of that sequence (no state, no
  ``seq_idx``): ``causal_conv1d.causal_conv1d_fn`` (the ``causal-conv1d`` package, with ``mamba_ssm``) and
  ``fla.modules.causal_conv1d.causal_conv1d`` (``fla.modules.conv`` in 0.4.2 - 0.5.x, ``fla.modules.convolution``
  before).

Rules (those of ``flashcp.runtime.kernels``): a library runs CUDA tensors only, of the dtypes its record
names; ``"auto"`` takes, on CUDA, the first library in ``LIBRARIES`` that runs the operation, and falls back
to the reference with one ``BackendFallbackWarning`` per message; on CPU it takes the reference silently. A
backend asked for by name that cannot run raises ``BackendUnavailableError`` with the reason in one
sentence. ``_is_cuda`` is the one place that looks at the device.

Dtypes: flashcp hands each entry point tensors in the compute dtype (float32 or wider) and the layer's own
dtype; the libraries run q, k, v, x, B, C in the layer's dtype when it is float16 or bfloat16 (else
float32), the log decay ``g``, ``dt``, ``A`` and the states in float32.

Shape legend: as ``flashcp.runtime.recurrent.chunked`` (``T`` tokens, ``N`` segments, ``G`` key heads or
B/C groups, ``H`` value / SSM heads, ``K``, ``V``, ``P``, ``S``, ``F``, ``L`` a sequence's length).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from flashcp.runtime.kernels.library import (
    BackendFallbackWarning,
    BackendUnavailableError,
    Unavailable,
    attribute,
    import_module,
    version_of,
)
from flashcp.runtime.recurrent.chunked import chunk_ssd, gated_delta_segments

__all__ = ["LIBRARIES", "OPERATIONS", "RECURRENT_BACKENDS", "RecurrentLibrary", "conv_kernel", "gated_delta",
           "resolve_recurrent_backend", "ssd"]

OPERATIONS = ("gated_delta", "ssd", "conv")
"""The operations a recurrent backend may run."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RecurrentLibrary:
    """One recurrent kernel library: how it loads, what it runs, and its entry points (None: not run).

    Entry points take what ``load`` returned first:

    - ``gated_delta(api, q_TGK, k_TGK, v_THV, g_TH, beta_TH, cu_seqlens, initial_NHKV, chunk_size, dtype) ->
      (out_THV, final_NHKV)``: q and k normalised and scaled, all in the compute dtype; ``dtype`` the layer's;
    - ``ssd(api, x_THP, dt_TH, A_H, B_TGS, C_TGS, cu_seqlens, initial_NHPS, chunk_size, carried) -> (y_THP,
      final_NHPS)``: no D term; ``carried`` (N,) bool: segments with a start state or a final state read
      (None: none); the final state of a segment not carried may be anything;
    - ``conv(api, x_LF, weight_FW, bias_F) -> y_LF``: the causal convolution of one sequence, before the
      activation, in x's dtype.
    """

    name: str
    """The backend name (``backend="fla"``)."""
    load: Callable[[], object]
    """Imports the library; raises ``Unavailable`` with the reason in a few words when it cannot."""
    needs_cuda: bool
    """Whether it runs CUDA tensors only."""
    dtypes: tuple[torch.dtype, ...] | None
    """The layer dtypes it runs; None: any."""
    gated_delta: Callable | None
    """Gated DeltaNet over segments (see the class docstring)."""
    ssd: Callable | None
    """Mamba-2 SSD over segments (see the class docstring)."""
    conv: Callable | None
    """The causal convolution of one sequence (see the class docstring)."""
    conv_widths: tuple[int, int] | None = None
    """The convolution widths it takes, first and last; None: any."""

    def runs(self, operation: str) -> bool:
        """Whether flashcp calls this library for ``operation`` (one of ``OPERATIONS``)."""
        return getattr(self, operation) is not None


GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _run_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a library runs a layer of ``dtype`` in: its half dtype, else float32."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32


def _declares(fn, name: str) -> bool:
    """Whether ``fn``'s signature names ``name`` (fla's entry points also take ``**kwargs``)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _bounds(cu_seqlens) -> list[int]:
    return [int(c) for c in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]


# ---------------------------------------------------------------- reference

def _reference_gated_delta(api, q_TGK, k_TGK, v_THV, g_TH, beta_TH, cu_seqlens, initial_NHKV, chunk_size, dtype):
    group = v_THV.shape[1] // k_TGK.shape[1]
    q, k = (x.repeat_interleave(group, dim=1) for x in (q_TGK, k_TGK))
    return gated_delta_segments(q, k, v_THV, g_TH, beta_TH, cu_seqlens, initial_NHKV, chunk_size)


def _reference_ssd(api, x_THP, dt_TH, A_H, B_TGS, C_TGS, cu_seqlens, initial_NHPS, chunk_size, carried):
    return chunk_ssd(x_THP, dt_TH, A_H, B_TGS, C_TGS, cu_seqlens, initial_NHPS, chunk_size=chunk_size)


def _reference_conv(api, x_LF, weight_FW, bias_F):
    width = weight_FW.shape[1]
    padded = F.pad(x_LF.T[None], (width - 1, 0))
    return F.conv1d(padded, weight_FW[:, None, :], bias_F, groups=x_LF.shape[1])[0].T


REFERENCE = RecurrentLibrary(name="reference", load=lambda: None, needs_cuda=False, dtypes=None,
                             gated_delta=_reference_gated_delta, ssd=_reference_ssd, conv=_reference_conv)
"""``chunked``'s pure-PyTorch kernels: any device and dtype (float64 included)."""


# ---------------------------------------------------------------- fla

_FLA_CONV_MODULES = ("fla.modules.causal_conv1d", "fla.modules.conv", "fla.modules.convolution")
"""Where fla's ``causal_conv1d`` lives: from 0.6.0, from 0.4.2 (``conv/``), before."""


def _load_fla():
    package = import_module("fla", "flash-linear-attention")
    ops = import_module("fla.ops.gated_delta_rule", "flash-linear-attention")
    chunk = attribute(ops, "chunk_gated_delta_rule")
    if not _declares(chunk, "cu_seqlens") or not _declares(chunk, "initial_state"):
        raise Unavailable("fla's chunk_gated_delta_rule takes no cu_seqlens and initial_state (an unsupported "
                          "release)", installed=True)
    conv = None
    for path in _FLA_CONV_MODULES:
        try:
            conv = import_module(path, "flash-linear-attention")
            break
        except Unavailable as e:
            if e.installed:
                raise
    if conv is None:
        raise Unavailable(f"fla has none of {', '.join(_FLA_CONV_MODULES)} (an unsupported release)", installed=True)
    version = str(getattr(package, "__version__", "0"))
    return SimpleNamespace(chunk_gated_delta_rule=chunk, causal_conv1d=attribute(conv, "causal_conv1d"),
                           grouped_values=version_of(version) >= (0, 5, 0),
                           host_offsets=_declares(chunk, "cu_seqlens_cpu"))


def _fla_gated_delta(api, q_TGK, k_TGK, v_THV, g_TH, beta_TH, cu_seqlens, initial_NHKV, chunk_size, dtype):
    run = _run_dtype(dtype)
    if not api.grouped_values:  # fla before 0.5.0: as many key heads as value heads
        group = v_THV.shape[1] // k_TGK.shape[1]
        q_TGK, k_TGK = (x.repeat_interleave(group, dim=1) for x in (q_TGK, k_TGK))
    q, k, v, beta = (x.to(run)[None] for x in (q_TGK, k_TGK, v_THV, beta_TH))
    host = torch.tensor(_bounds(cu_seqlens), dtype=torch.int64)
    # the offsets on the host too, where the release takes them: its chunk indices need no device sync
    options = {"cu_seqlens_cpu": host} if api.host_offsets else {}
    initial = None if initial_NHKV is None else initial_NHKV.float()
    out, final = api.chunk_gated_delta_rule(q, k, v, g_TH.float()[None], beta, scale=1.0, initial_state=initial,
                                            output_final_state=True, use_qk_l2norm_in_kernel=False,
                                            cu_seqlens=host.to(v.device), **options)
    return out[0], final


def _fla_conv(api, x_LF, weight_FW, bias_F):
    y, _ = api.causal_conv1d(x_LF[None], weight_FW.to(x_LF.dtype),
                             None if bias_F is None else bias_F.to(x_LF.dtype), activation=None)
    return y[0]


FLA = RecurrentLibrary(name="fla", load=_load_fla, needs_cuda=True, dtypes=GPU_DTYPES,
                       gated_delta=_fla_gated_delta, ssd=None, conv=_fla_conv)
"""flash-linear-attention: the gated delta rule and the short convolution (Triton)."""


# ---------------------------------------------------------------- mamba_ssm

def _load_mamba():
    import_module("mamba_ssm", "mamba-ssm")
    combined = import_module("mamba_ssm.ops.triton.ssd_combined", "mamba-ssm")
    scan = attribute(combined, "mamba_chunk_scan_combined")
    missing, conv_fn = {}, None
    try:  # mamba-ssm's optional dependency: without it the SSD runs, the convolution does not
        conv_fn = attribute(import_module("causal_conv1d", "causal-conv1d"), "causal_conv1d_fn")
    except Unavailable as e:
        missing["conv"] = str(e)
    return SimpleNamespace(mamba_chunk_scan_combined=scan, causal_conv1d_fn=conv_fn, missing=missing,
                           state_dtype=_declares(scan, "state_dtype"))


def _mamba_ssd(api, x_THP, dt_TH, A_H, B_TGS, C_TGS, cu_seqlens, initial_NHPS, chunk_size, carried):
    bounds = _bounds(cu_seqlens)
    num_segments, num_heads = len(bounds) - 1, x_THP.shape[1]
    run = _run_dtype(x_THP.dtype)
    x, B, C = (t.to(run) for t in (x_THP, B_TGS, C_TGS))
    dt, A = dt_TH.float(), A_H.float()
    options = {"state_dtype": torch.float32} if api.state_dtype else {}
    carried = np.zeros(num_segments, dtype=bool) if carried is None else np.asarray(carried, dtype=bool)
    device = x.device
    y = x.new_zeros(x.shape)
    final = torch.zeros(num_segments, num_heads, x.shape[2], B.shape[2], dtype=torch.float32, device=device)
    lengths = np.diff(bounds)
    starts = np.asarray(bounds[:-1], dtype=np.int64)
    # segments from zero whose final state nobody reads: one row, seq_idx keeps them apart
    plain = np.flatnonzero(~carried & (lengths > 0))
    if len(plain):
        index = torch.from_numpy(np.concatenate([np.arange(starts[i], starts[i] + lengths[i]) for i in plain]))
        index = index.to(device)
        seq_idx = torch.from_numpy(np.repeat(np.arange(len(plain), dtype=np.int32), lengths[plain])).to(device)
        out = api.mamba_chunk_scan_combined(*(t.index_select(0, index)[None] for t in (x, dt)), A,
                                            *(t.index_select(0, index)[None] for t in (B, C)), chunk_size,
                                            seq_idx=seq_idx[None], **options)
        y = y.index_copy(0, index, out[0].to(y.dtype))
    # carried segments: one row each, zero-padded (dt = 0 keeps the state), a start state per row
    rows = np.flatnonzero(carried)
    if len(rows):
        length = max(int(lengths[rows].max()), 1)
        token = np.concatenate([np.arange(starts[i], starts[i] + lengths[i]) for i in rows])
        slot = np.concatenate([r * length + np.arange(lengths[i]) for r, i in enumerate(rows)])
        token_t, slot_t = (torch.from_numpy(a).to(device) for a in (token, slot))

        def padded(t):
            flat = t.new_zeros((len(rows) * length, *t.shape[1:])).index_copy(0, slot_t, t.index_select(0, token_t))
            return flat.view(len(rows), length, *t.shape[1:])

        rows_t = torch.from_numpy(rows).to(device)
        initial = None if initial_NHPS is None else initial_NHPS.float().index_select(0, rows_t).contiguous()
        out, last = api.mamba_chunk_scan_combined(padded(x), padded(dt), A, padded(B), padded(C), chunk_size,
                                                  initial_states=initial, return_final_states=True, **options)
        y = y.index_copy(0, token_t, out.reshape(-1, *out.shape[2:]).index_select(0, slot_t).to(y.dtype))
        final = final.index_copy(0, rows_t, last.float())
    return y, final


def _mamba_conv(api, x_LF, weight_FW, bias_F):
    # (1, F, L): channel-last (no copy) needs F and the strides multiples of 8 (csrc/causal_conv1d.cpp)
    x = x_LF.T[None] if x_LF.shape[1] % 8 == 0 and x_LF.is_contiguous() else x_LF.T.contiguous()[None]
    y = api.causal_conv1d_fn(x, weight_FW.to(x_LF.dtype),
                             None if bias_F is None else bias_F.to(x_LF.dtype), activation=None)
    return y[0].T


MAMBA_SSM = RecurrentLibrary(name="mamba_ssm", load=_load_mamba, needs_cuda=True, dtypes=GPU_DTYPES,
                             gated_delta=None, ssd=_mamba_ssd, conv=_mamba_conv, conv_widths=(2, 4))
"""mamba_ssm's SSD (Triton) with the ``causal-conv1d`` package's convolution (CUDA)."""


LIBRARIES: dict[str, RecurrentLibrary] = {library.name: library for library in (FLA, MAMBA_SSM, REFERENCE)}
"""Every recurrent backend by name; ``"auto"`` tries the GPU ones in this order, then the reference."""
RECURRENT_BACKENDS = tuple(LIBRARIES)
"""Every recurrent backend name."""


# ---------------------------------------------------------------- choosing a backend

def _is_cuda(device: torch.device) -> bool:
    """Whether tensors on ``device`` can run a GPU library: the one place that looks at the device."""
    return device.type == "cuda"


@functools.cache
def _load(backend: str):
    try:
        return LIBRARIES[backend].load()
    except Unavailable as e:
        return e


def _why_not(backend: str, operation: str, x: torch.Tensor, width: int | None = None) -> str | None:
    """None when ``backend`` runs ``operation`` on tensors like ``x``, else the reason in a few words.

    ``width``: the convolution's (``operation == "conv"``).
    """
    library = LIBRARIES.get(backend)
    if library is None:
        return f"unknown backend '{backend}' (choose from {', '.join(RECURRENT_BACKENDS)} or auto)"
    if not library.runs(operation):
        runs = ", ".join(op for op in OPERATIONS if library.runs(op))
        return f"flashcp runs only {runs} on {backend}, not {operation}"
    if library.needs_cuda and not _is_cuda(x.device):
        return f"{backend} needs CUDA tensors, got {x.device.type}"
    if library.dtypes is not None and x.dtype not in library.dtypes:
        return f"{backend} needs {' or '.join(str(d).removeprefix('torch.') for d in library.dtypes)}, got {x.dtype}"
    api = _load(backend)
    if isinstance(api, Unavailable):
        return str(api)
    missing = getattr(api, "missing", {}).get(operation)  # a part of the library that is not there
    if missing is None and operation == "conv" and width is not None and library.conv_widths is not None and \
            not library.conv_widths[0] <= width <= library.conv_widths[1]:
        return f"{backend} takes convolution widths {library.conv_widths[0]} to {library.conv_widths[1]}, got {width}"
    return missing


_warned: set[str] = set()


def resolve_recurrent_backend(backend: str, operation: str, x: torch.Tensor, width: int | None = None) -> str:
    """The backend that runs ``operation`` (``OPERATIONS``) on tensors like ``x`` for ``backend``.

    ``"auto"``: on CUDA the first library of ``LIBRARIES`` that runs it, else ``"reference"`` with one
    ``BackendFallbackWarning``; on other devices ``"reference"``. A named backend that cannot run raises
    ``BackendUnavailableError`` saying why. ``width``: the convolution's, for ``"conv"``.
    """
    if operation not in OPERATIONS:
        raise ValueError(f"operation must be one of {', '.join(OPERATIONS)}, got {operation!r}")
    if backend != "auto":
        why = _why_not(backend, operation, x, width)
        if why is not None:
            raise BackendUnavailableError(f"recurrent backend '{backend}' cannot run {operation} here: {why}")
        return backend
    if not _is_cuda(x.device):
        return "reference"
    reasons, missing = [], True
    for name, library in LIBRARIES.items():
        if name == "reference" or not library.runs(operation):
            continue
        why = _why_not(name, operation, x, width)
        if why is None:
            return name
        reasons.append(why if why.startswith(f"{name} ") else f"{name} ({why})")
        api = _load(name)
        missing = missing and isinstance(api, Unavailable) and not api.installed
    hint = " (pip install --no-build-isolation 'flashcp[linear]')" if missing else ""
    message = (f"recurrent backend auto found no GPU kernel for {operation} on {x.dtype} tensors on {x.device} "
               f"({'; '.join(reasons)}): running the pure-PyTorch reference{hint}")
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, BackendFallbackWarning, stacklevel=3)
    return "reference"


def _entry(backend: str, operation: str, x: torch.Tensor):
    name = resolve_recurrent_backend(backend, operation, x)
    return getattr(LIBRARIES[name], operation), _load(name)


# ---------------------------------------------------------------- the entry points

def gated_delta(q_TGK: torch.Tensor, k_TGK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
                beta_TH: torch.Tensor, cu_seqlens, initial_state_NHKV: torch.Tensor | None, chunk_size: int, *,
                dtype: torch.dtype, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet over segments on ``backend``: ``(out_THV, final_NHKV)``, the states float32 or wider.

    Args:
        q_TGK: queries (T, G, K), normalised and scaled, in the compute dtype; value head h reads ``h // (H // G)``.
        k_TGK: keys (T, G, K), normalised, in the compute dtype.
        v_THV: values (T, H, V), in the compute dtype.
        g_TH: log decay (T, H), in the compute dtype.
        beta_TH: write strength (T, H), in the compute dtype.
        cu_seqlens: (N + 1,) int segment offsets, 0 first.
        initial_state_NHKV: (N, H, K, V) or None (zeros).
        chunk_size: the reference's chunk (the libraries use their own).
        dtype: the layer's dtype (what a library runs in).
        backend: one of ``RECURRENT_BACKENDS`` or ``"auto"``, resolved on a tensor of ``dtype`` on v's device.
    """
    run, api = _entry(backend, "gated_delta", v_THV.new_empty(0, dtype=dtype))
    return run(api, q_TGK, k_TGK, v_THV, g_TH, beta_TH, cu_seqlens, initial_state_NHKV, chunk_size, dtype)


def ssd(x_THP: torch.Tensor, dt_TH: torch.Tensor, A_H: torch.Tensor, B_TGS: torch.Tensor, C_TGS: torch.Tensor,
        cu_seqlens, initial_state_NHPS: torch.Tensor | None, chunk_size: int, *, carried=None,
        backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2 SSD over segments on ``backend`` without the D term: ``(y_THP, final_NHPS)``.

    Args: as ``chunked.chunk_ssd`` (x in the layer's dtype), plus ``carried``: (N,) bool, the segments with a
    start state or whose final state is read (None: none; only those finals are defined with ``mamba_ssm``),
    and ``backend`` (resolved on ``x_THP``).
    """
    run, api = _entry(backend, "ssd", x_THP)
    return run(api, x_THP, dt_TH, A_H, B_TGS, C_TGS, cu_seqlens, initial_state_NHPS, chunk_size, carried)


def conv_kernel(backend: str, x: torch.Tensor, width: int) -> Callable | None:
    """The causal convolution ``kernel(x_LF, weight_FW, bias_F) -> y_LF`` of ``backend`` for tensors like ``x``.

    ``width``: the filters' taps. None for the reference (``chunked.causal_conv1d``'s own ``F.conv1d``).
    """
    name = resolve_recurrent_backend(backend, "conv", x, width)
    if name == "reference":
        return None
    run, api = LIBRARIES[name].conv, _load(name)
    assert run is not None
    return lambda x_LF, weight_FW, bias_F: run(api, x_LF, weight_FW, bias_F)

