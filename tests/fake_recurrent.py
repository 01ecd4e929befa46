"""CPU emulations of the recurrent GPU libraries flashcp calls, for CI without a GPU.

Each fake is written from the library's own source and mimics its Python API (module paths, names,
parameters, defaults, return values) and the checks its wrapper makes; it computes with a plain token-by-token
recurrence in float32 (what the kernels accumulate in), never with flashcp's chunked kernels, so that a test
through a fake is an independent check. Gradients come from autograd through that recurrence (the libraries'
backward kernels compute the same derivatives, ``dh0`` of the initial states and ``dht`` of the final ones
included).

- ``fla-0.5``: flash-linear-attention 0.5.2 (commit bc3b101d, 2026-08-22): ``fla/ops/gated_delta_rule/chunk.py``
  ``chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
  use_qk_l2norm_in_kernel=False, ..., cu_seqlens=None, ...)``: ``[B, T, H, K]`` q and k, ``[B, T, HV, V]`` v
  with ``HV % H == 0`` (GVA from 0.5.0: value head h reads key head ``h // (HV // H)``, as
  ``fla/ops/common/chunk_delta_h.py`` indexes), ``g`` in log space, ``B == 1`` and ``initial_state``
  ``[N, HV, K, V]`` with ``cu_seqlens``, returns ``(o in q's dtype, final_state float32 or None)``; the
  recurrence of ``fla/ops/gated_delta_rule/naive.py`` (``naive_recurrent_gated_delta_rule``: decay, delta
  ``beta (v - S^T k)``, write, read); ``fla/modules/conv/causal_conv1d.py`` ``causal_conv1d(x [B, T, D],
  weight [D, W], bias, residual, initial_state, output_final_state, activation, backend, cu_seqlens, ...)
  -> (y, final_state)``;
- ``fla-0.6``: 0.6.0 (the PyPI ``fla-core`` 0.6.0 wheel): the same ``chunk_gated_delta_rule``, the convolution
  moved to ``fla/modules/causal_conv1d/ops.py``;
- ``fla-0.4``: 0.4.2 (tag v0.4.2): as above without GVA (its kernels read the head count off k and would
  index v wrongly with more value heads: the fake refuses), the convolution in ``fla/modules/convolution.py``;
- ``mamba_ssm-2.3``: mamba 2.3.2 (tag v2.3.2) ``mamba_ssm/ops/triton/ssd_combined.py``
  ``mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
  seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, inf), return_final_states=False,
  return_varlen_states=False)``: one initial state per batch row, the state zeroed where ``seq_idx`` changes
  (``ssd_state_passing.py``), final states in C's dtype; ``return_varlen_states`` has no backward;
- ``mamba_ssm-main``: its main branch (commit e9594ce1, 2026-07-23), with ``state_dtype`` (final states in it);
- ``mamba_ssm-no-conv``: ``mamba_ssm-main`` without causal-conv1d (mamba-ssm's optional dependency);
- ``causal_conv1d``: causal-conv1d 1.6.1 (commit 0d2252d1) ``causal_conv1d_fn(x (batch, dim, seqlen), weight
  (dim, width), bias=None, seq_idx=None, initial_states=None, return_final_states=False,
  final_states_out=None, activation=None)``, installed with the first two mamba_ssm fakes.

``install(*names)`` puts the fakes in ``sys.modules`` (the other libraries read as not installed) and makes
``flashcp.runtime.recurrent.backends._is_cuda`` say yes for every device; it returns undo().
"""

import math
import sys
import types

import torch
import torch.nn.functional as F

from flashcp.runtime.recurrent import backends
from tests.fake_kernels import _Broken, check

FAKES = ("fla-0.6", "fla-0.5", "fla-0.4", "mamba_ssm-2.3", "mamba_ssm-main", "mamba_ssm-no-conv")
"""Every emulated release."""
MODULES = ("fla", "fla.ops", "fla.ops.gated_delta_rule", "fla.modules", "fla.modules.causal_conv1d", "fla.modules.conv",
           "fla.modules.convolution", "mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton",
           "mamba_ssm.ops.triton.ssd_combined", "causal_conv1d")


def _module(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    return module


# ---------------------------------------------------------------- fla

def _fla_l2norm(x):
    """``fla/modules/l2norm.py``: ``x / sqrt(sum(x^2) + 1e-6)`` in float32."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _gated_delta_sequence(q, k, v, g, beta, state):
    """``naive_recurrent_gated_delta_rule`` on one sequence: q, k (T, HV, K); v (T, HV, V); g, beta (T, HV)."""
    out = []
    for t in range(v.shape[0]):
        state = state * g[t].exp()[:, None, None]
        delta = (v[t] - (state * k[t][:, :, None]).sum(-2)) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hd,hdm->hm", q[t], state))
    return (torch.stack(out) if out else v.new_zeros(v.shape)), state


def _make_chunk_gated_delta_rule(grouped_values: bool):
    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                               allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                               chunk_indices=None, cp_context=None, **kwargs):
        if q.shape[2] != k.shape[2]:
            raise ValueError(f"q and k must have the same number of heads, but got q.shape[2]={q.shape[2]} and "
                             f"k.shape[2]={k.shape[2]}")
        heads, value_heads = q.shape[2], v.shape[2]
        if grouped_values:
            if value_heads % heads:
                raise ValueError(f"For GVA, num_v_heads (HV={value_heads}) must be evenly divisible by "
                                 f"num_heads (H={heads}), but got HV % H = {value_heads % heads}")
        else:
            check(value_heads == heads, "fla 0.4 reads the head count off k: v must have as many heads")
        check(not use_beta_sigmoid_in_kernel and not state_v_first and cp_context is None,
              "the fake runs the plain path only")
        if cu_seqlens is not None:
            if q.shape[0] != 1:
                raise ValueError(f"The batch size is expected to be 1 rather than {q.shape[0]} when using "
                                 f"`cu_seqlens`.Please flatten variable-length inputs before processing.")
            if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
                raise ValueError(f"The number of initial states is expected to be equal to the number of input "
                                 f"sequences, i.e., {len(cu_seqlens) - 1} rather than {initial_state.shape[0]}.")
            check(cu_seqlens.dtype in (torch.int32, torch.int64), "cu_seqlens must be a LongTensor")
            bounds = cu_seqlens.tolist()
            check(cu_seqlens_cpu is None or cu_seqlens_cpu.tolist() == bounds, "cu_seqlens_cpu must equal cu_seqlens")
        else:
            bounds = None
        for name, t in (("k", k), ("v", v), ("beta", beta)):  # as fla's layers pass them; the fake holds flashcp to it
            check(t.dtype == q.dtype, f"{name} must have q's dtype")
        scale = k.shape[-1] ** -0.5 if scale is None else scale
        group = value_heads // heads
        qf, kf = (x.float().repeat_interleave(group, dim=2) for x in (q, k))
        if use_qk_l2norm_in_kernel:
            qf, kf = _fla_l2norm(qf), _fla_l2norm(kf)
        qf = qf * scale
        vf, gf, bf = v.float(), g.float(), beta.float()
        outs, finals = [], []
        rows = [(b, 0, q.shape[1]) for b in range(q.shape[0])] if bounds is None else \
            [(0, a, b) for a, b in zip(bounds, bounds[1:])]
        for n, (row, start, end) in enumerate(rows):
            state = (vf.new_zeros(value_heads, k.shape[-1], v.shape[-1]) if initial_state is None
                     else initial_state[n].float())
            out, state = _gated_delta_sequence(qf[row, start:end], kf[row, start:end], vf[row, start:end],
                                               gf[row, start:end], bf[row, start:end], state)
            outs.append(out)
            finals.append(state)
        o = torch.cat(outs)[None] if bounds is not None else torch.stack(outs)
        return o.to(q.dtype), (torch.stack(finals) if output_final_state else None)

    if grouped_values:
        return chunk_gated_delta_rule

    def chunk_gated_delta_rule_0_4(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                   use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None,
                                   cp_context=None, transpose_state_layout=False, **kwargs):
        """v0.4.2's signature."""
        check(not transpose_state_layout, "the fake runs the [K, V] state layout only")
        return chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                      use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                      cp_context=cp_context)

    return chunk_gated_delta_rule_0_4


def _depthwise_causal(x_BDT, weight, bias):
    """``y[:, :, t] = bias + sum_j weight[:, j] x[:, :, t - (W-1) + j]``, zeros before the start, float32."""
    width = weight.shape[1]
    x = x_BDT.float()
    y = x.new_zeros(x.shape) + (0 if bias is None else bias.float()[None, :, None])
    for j in range(width):
        back = width - 1 - j
        y[:, :, back:] = y[:, :, back:] + weight.float()[None, :, j, None] * x[:, :, :x.shape[2] - back]
    return y


def fla_causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                      activation=None, backend="triton", cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                      cp_context=None, **kwargs):
    """``fla.modules.conv.causal_conv1d`` without states or cu_seqlens: (y [B, T, D], None)."""
    check(initial_state is None and cu_seqlens is None and residual is None and not output_final_state,
          "the fake runs the stateless path only")
    check(activation in (None, "silu", "swish"), "activation must be None, silu or swish")
    check(x.shape[-1] == weight.shape[0], "x's last dim must be weight's first")
    y = _depthwise_causal(x.transpose(1, 2), weight, bias).transpose(1, 2)
    return (F.silu(y) if activation else y).to(x.dtype), None


def _make_fla(release: str) -> dict:
    version = {"fla-0.6": "0.6.0", "fla-0.5": "0.5.2", "fla-0.4": "0.4.2"}[release]
    chunk = _make_chunk_gated_delta_rule(grouped_values=release != "fla-0.4")
    conv_name = {"fla-0.6": "fla.modules.causal_conv1d", "fla-0.5": "fla.modules.conv",
                 "fla-0.4": "fla.modules.convolution"}[release]
    modules = {"fla": _module("fla", __version__=version), "fla.ops": _module("fla.ops"),
               "fla.ops.gated_delta_rule": _module("fla.ops.gated_delta_rule", chunk_gated_delta_rule=chunk),
               "fla.modules": _module("fla.modules"), conv_name: _module(conv_name, causal_conv1d=fla_causal_conv1d)}
    for name in ("fla", "fla.ops", "fla.modules"):
        modules[name].__path__ = []
    return modules


# ---------------------------------------------------------------- mamba_ssm and causal-conv1d

def _make_mamba_chunk_scan_combined(state_dtype_parameter: bool):
    def scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
             cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, math.inf), return_final_states=False,
             return_varlen_states=False, state_dtype=None):
        batch, seqlen, nheads, headdim = x.shape
        _, _, ngroups, dstate = B.shape
        assert nheads % ngroups == 0
        assert B.shape == (batch, seqlen, ngroups, dstate)
        assert dt.shape == (batch, seqlen, nheads)
        assert A.shape == (nheads,)
        assert C.shape == B.shape
        if D is not None:
            assert D.shape == (nheads, headdim) or D.shape == (nheads,)
        if seq_idx is not None:
            assert seq_idx.shape == (batch, seqlen)
        if initial_states is not None:
            assert initial_states.shape == (batch, nheads, headdim, dstate)
        check(z is None and not return_varlen_states, "the fake runs the plain path only")
        dt = dt.float()
        if dt_bias is not None:
            dt = dt + dt_bias.float()
        if dt_softplus:
            dt = F.softplus(dt)
        if dt_limit != (0.0, math.inf):
            dt = dt.clamp(*dt_limit)
        group = nheads // ngroups
        Bf, Cf = (t.float().repeat_interleave(group, dim=2) for t in (B, C))
        xf, Af = x.float(), A.float()
        outs, finals = [], []
        for b in range(batch):
            state = xf.new_zeros(nheads, headdim, dstate) if initial_states is None else initial_states[b].float()
            row = []
            for t in range(seqlen):
                if seq_idx is not None and t > 0 and seq_idx[b, t] != seq_idx[b, t - 1]:
                    state = state * 0  # a new sequence starts from zero (ssd_state_passing.py)
                decay = (dt[b, t] * Af).exp()[:, None, None]
                state = decay * state + dt[b, t][:, None, None] * xf[b, t][:, :, None] * Bf[b, t][:, None, :]
                y = (state @ Cf[b, t][:, :, None])[..., 0]
                if D is not None:
                    y = y + (D.float()[:, None] if D.dim() == 1 else D.float()) * xf[b, t]
                row.append(y)
            outs.append(torch.stack(row) if row else xf.new_zeros(0, nheads, headdim))
            finals.append(state)
        out = torch.stack(outs).to(x.dtype)
        if not return_final_states:
            return out
        return out, torch.stack(finals).to(state_dtype if state_dtype is not None else C.dtype)

    if state_dtype_parameter:
        return scan

    def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                                  seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, math.inf),
                                  return_final_states=False, return_varlen_states=False):
        return scan(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus,
                    dt_limit, return_final_states, return_varlen_states)

    return mamba_chunk_scan_combined


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    """``causal_conv1d.causal_conv1d_fn`` without states or seq_idx: y (batch, dim, seqlen)."""
    if activation not in [None, "silu", "swish"]:
        raise NotImplementedError("activation must be None, silu, or swish")
    check(x.stride(2) == 1 or x.stride(1) == 1, "x.stride(2) == 1 || x.stride(1) == 1")
    if x.stride(1) == 1 and x.stride(2) > 1:  # channel-last
        check(x.shape[1] % 8 == 0, "causal_conv1d only supports channel dimension divisible by 8 for now")
        check(x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0, "causal_conv1d with channel last layout requires "
              "strides (x.stride(0) and x.stride(2)) to be multiples of 8")
    check(2 <= weight.shape[1] <= 4, "causal_conv1d only supports width between 2 and 4")
    check(bias is None or bias.dtype == weight.dtype, "bias.scalar_type() == weight_type")
    check(seq_idx is None and initial_states is None and not return_final_states,
          "the fake runs the stateless path only")
    y = _depthwise_causal(x, weight, bias)
    return (F.silu(y) if activation else y).to(x.dtype)


def _make_mamba(release: str) -> dict:
    scan = _make_mamba_chunk_scan_combined(state_dtype_parameter=release != "mamba_ssm-2.3")
    modules = {"mamba_ssm": _module("mamba_ssm", __version__="2.3.2"), "mamba_ssm.ops": _module("mamba_ssm.ops"),
               "mamba_ssm.ops.triton": _module("mamba_ssm.ops.triton"),
               "mamba_ssm.ops.triton.ssd_combined": _module("mamba_ssm.ops.triton.ssd_combined",
                                                            mamba_chunk_scan_combined=scan),
               "causal_conv1d": _module("causal_conv1d", __version__="1.6.1", causal_conv1d_fn=causal_conv1d_fn)}
    for name in ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton"):
        modules[name].__path__ = []
    if release == "mamba_ssm-no-conv":
        modules["causal_conv1d"] = None
    return modules


# ---------------------------------------------------------------- installing

def install(*names: str, broken: dict | None = None):
    """Make ``names`` the installed recurrent libraries, every device a CUDA one to flashcp; returns undo().

    ``broken``: module name -> exception raised on import (a wheel built for another torch, say).
    """
    unknown = [n for n in names if n not in FAKES]
    if unknown:
        raise ValueError(f"unknown fakes {unknown}")
    saved = {m: sys.modules.get(m) for m in MODULES}
    saved_is_cuda = backends._is_cuda
    modules: dict = dict.fromkeys(MODULES)  # None in sys.modules: "not installed"
    for name in names:
        modules.update(_make_fla(name) if name.startswith("fla") else _make_mamba(name))
    finders = [_Broken(module, error) for module, error in (broken or {}).items()]
    for finder in finders:
        modules.pop(finder.module, None)
        sys.modules.pop(finder.module, None)
        sys.meta_path.insert(0, finder)
    sys.modules.update(modules)
    backends._is_cuda = lambda device: True
    _reset()

    def undo():
        for finder in finders:
            sys.meta_path.remove(finder)
        for module, value in saved.items():
            if value is None:
                sys.modules.pop(module, None)
            else:
                sys.modules[module] = value
        backends._is_cuda = saved_is_cuda
        _reset()

    return undo


def _reset():
    backends._load.cache_clear()
    backends._warned.clear()
