"""Chunked pure-PyTorch kernels of the recurrent layers: Gated DeltaNet, Mamba-2 SSD, the short convolution.

The reference kernels of ``flashcp.runtime.recurrent``: they run on CPU, in float64 for the tests, and are
what the CP layer calls when no GPU kernel is asked for. Each takes *segments* of a rank's tokens
(``cu_seqlens``, the pieces of documents it holds) with an initial state per segment and returns the final
state per segment; nothing crosses a segment boundary.

The math is that of transformers' pure-PyTorch paths, written for segments: Qwen3-Next's
``torch_chunk_gated_delta_rule`` (the WY/UT transform inside a chunk, a sequential scan over chunks) and
Mamba-2 / NemotronH's ``mamba2_chunk_scan`` (SSD: a masked quadratic form inside a chunk, states between
chunks). Segments are padded at their end to a common length, a multiple of the chunk: a padded step has
zero key, value and decay (GDN: ``g = beta = 0``; SSD: ``dt = 0``), so it leaves the state as it is and the
final state of the padded segment is the segment's own.

Precision: the recurrence runs in the inputs' dtype promoted to float32 at least (transformers runs float32;
float64 inputs stay float64); outputs come back in the inputs' dtype, final states in the compute dtype.

Shape legend: ``T`` tokens (segments back to back), ``N`` segments, ``L`` padded segment length, ``Hk`` key
heads, ``H`` value / SSM heads, ``K`` key dim, ``V`` value dim, ``P`` SSM head dim, ``G`` B/C groups, ``S``
SSM state size, ``F`` convolution channels, ``W`` convolution width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d", "chunk_gated_delta_rule", "chunk_ssd", "compute_dtype", "gated_delta_segments", "l2norm",
           "normalize_qk", "prepare_qk"]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, as fla and transformers' ``l2norm``."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a recurrence runs in: ``dtype`` promoted to float32 at least."""
    return torch.promote_types(dtype, torch.float32)


def _segments(cu_seqlens, num_tokens: int) -> list[int]:
    bounds = [int(c) for c in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
    if not bounds or bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {bounds[:8]}...")
    if bounds[-1] != num_tokens:
        raise ValueError(f"cu_seqlens ends at {bounds[-1]}, but the inputs have {num_tokens} tokens")
    return bounds


class _Padding:
    """Where the tokens of segments ``cu_seqlens`` sit in a (N, L) padded batch, L a multiple of ``chunk``."""

    def __init__(self, bounds: list[int], chunk: int, device: torch.device):
        lengths = torch.tensor(bounds, dtype=torch.int64).diff()
        self.num_segments = int(lengths.shape[0])
        longest = max((b - a for a, b in zip(bounds, bounds[1:])), default=0)
        self.length = max(-(-longest // chunk) * chunk, chunk)
        # token t of segment i goes to row i * L + (t - bounds[i])
        shift = torch.arange(self.num_segments) * self.length - torch.tensor(bounds[:-1], dtype=torch.int64)
        self.rows = (torch.repeat_interleave(shift, lengths) + torch.arange(bounds[-1])).to(device)

    def pad(self, x_T: torch.Tensor) -> torch.Tensor:
        """(T, ...) -> (N, L, ...), zeros after each segment's end."""
        flat = x_T.new_zeros((self.num_segments * self.length, *x_T.shape[1:])).index_copy(0, self.rows, x_T)
        return flat.view(self.num_segments, self.length, *x_T.shape[1:])

    def unpad(self, x_NL: torch.Tensor) -> torch.Tensor:
        """(N, L, ...) -> (T, ...)."""
        return x_NL.reshape(self.num_segments * self.length, *x_NL.shape[2:]).index_select(0, self.rows)


def _initial(state: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if state is None:
        return like.new_zeros(shape)
    if tuple(state.shape) != shape:
        raise ValueError(f"the initial state has shape {tuple(state.shape)}, the segments need {shape}")
    return state.to(like.dtype)


def chunk_gated_delta_rule(q_TGK: torch.Tensor, k_TGK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
                           beta_TH: torch.Tensor, cu_seqlens, initial_state_NHKV: torch.Tensor | None = None, *,
                           chunk_size: int = 64, scale: float | None = None,
                           use_qk_l2norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet over segments, each from its own initial state: ``(out_THV, final_NHKV)``.

    Per value head, with the state S (K, V): ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t
    v_t^T``, ``o_t = S_t^T q_t`` (Qwen3-Next, fla's ``chunk_gated_delta_rule``).

    Args:
        q_TGK: queries, (T, Hk, K); any float dtype.
        k_TGK: keys, (T, Hk, K).
        v_THV: values, (T, H, V), ``H % Hk == 0``: value head h reads key head ``h // (H // Hk)``.
        g_TH: log decay per token and head, (T, H), <= 0.
        beta_TH: write strength, (T, H), usually in (0, 1).
        cu_seqlens: (N + 1,) int segment offsets (list or tensor), 0 first.
        initial_state_NHKV: (N, H, K, V) state before each segment; None: zeros.
        chunk_size: tokens per chunk of the scan.
        scale: factor on q after the normalisation; None: ``K ** -0.5``.
        use_qk_l2norm: L2-normalise q and k first (Qwen3-Next does).

    Returns the output (T, H, V) in q's dtype and the state after each segment (N, H, K, V) in the compute
    dtype (float32 or wider).
    """
    q_THK, k_THK = prepare_qk(q_TGK, k_TGK, v_THV.shape[1], scale, use_qk_l2norm)
    dtype = q_THK.dtype
    return gated_delta_segments(q_THK, k_THK, v_THV.to(dtype), g_TH.to(dtype), beta_TH.to(dtype), cu_seqlens,
                                initial_state_NHKV, chunk_size, out_dtype=q_TGK.dtype)


def _repeat_groups(a_TGX: torch.Tensor, b_TGX: torch.Tensor, num_heads: int, dtype: torch.dtype, *, rule: str,
                   names: tuple[str, str], heads: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` in ``dtype``, each of their G groups repeated for the ``H // G`` heads that read it: (T, H, X).

    ValueError, worded by ``rule``, the two ``names`` and the word for the ``heads``, unless ``a`` and ``b``
    have one shape and G divides H.
    """
    if a_TGX.shape != b_TGX.shape or num_heads % b_TGX.shape[1]:
        raise ValueError(f"{rule}, got {names[0]} {tuple(a_TGX.shape)}, {names[1]} {tuple(b_TGX.shape)} and "
                         f"{num_heads} {heads}")
    group = num_heads // b_TGX.shape[1]
    a, b = (x.to(dtype).repeat_interleave(group, dim=1) for x in (a_TGX, b_TGX))
    return a, b


def prepare_qk(q_TGK, k_TGK, num_heads: int, scale: float | None, use_qk_l2norm: bool):
    """The queries and keys per value head in the compute dtype, normalised and q scaled: (T, H, K) each."""
    q, k = _repeat_groups(q_TGK, k_TGK, num_heads, compute_dtype(q_TGK.dtype),
                          rule="q and k must be (T, Hk, K) alike with H % Hk == 0", names=("q", "k"),
                          heads="value heads")
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k


def normalize_qk(q_TGK, k_TGK, num_heads: int, scale: float | None, use_qk_l2norm: bool):
    """The queries and keys per key head in the compute dtype, normalised and q scaled: (T, G, K) each.

    ``prepare_qk`` before the repeat per value head (the ``fla`` backend takes the key heads as they are).
    """
    if q_TGK.shape != k_TGK.shape or num_heads % k_TGK.shape[1]:
        raise ValueError(f"q and k must be (T, Hk, K) alike with H % Hk == 0, got q {tuple(q_TGK.shape)}, "
                         f"k {tuple(k_TGK.shape)} and {num_heads} value heads")
    dtype = compute_dtype(q_TGK.dtype)
    q, k = q_TGK.to(dtype), k_TGK.to(dtype)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k


def gated_delta_segments(q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens, initial_state_NHKV, chunk_size: int,
                         out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_gated_delta_rule`` on q and k already per value head, normalised and scaled, all in one dtype.

    ``v_THV``'s last dim may be anything (the CP layer runs ``[I | 0]`` states with ``[0 | v]`` values).
    """
    bounds = _segments(cu_seqlens, v_THV.shape[0])
    num_heads, head_k, head_v = v_THV.shape[1], k_THK.shape[2], v_THV.shape[2]
    padding = _Padding(bounds, chunk_size, v_THV.device)
    state = _initial(initial_state_NHKV, (padding.num_segments, num_heads, head_k, head_v), v_THV)
    if padding.num_segments == 0:
        return v_THV.to(out_dtype or v_THV.dtype), state
    q, k, v, g, beta = (padding.pad(x).transpose(1, 2) for x in (q_THK, k_THK, v_THV, g_TH, beta_TH))
    out, state = _gated_delta_chunks(q, k, v, g, beta, state, chunk_size)
    return padding.unpad(out.transpose(1, 2)).to(out_dtype or v_THV.dtype), state


def _gated_delta_chunks(q, k, v, g, beta, state, chunk: int):
    """q, k: (N, H, L, K); v: (N, H, L, V); g, beta: (N, H, L); state: (N, H, K, V); L a multiple of chunk."""
    n, h, length, _ = k.shape
    q, k, v = (x.reshape(n, h, length // chunk, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(n, h, length // chunk, chunk) for x in (g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)  # log of the decay from the chunk's start to each position
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).triu(1)
    # decay between positions j <= i of a chunk; masked before exp so that no positive exponent overflows
    pair_decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    # the UT transform: the chunk's delta updates as one triangular solve (diagonal taken as 1)
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                               unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * pair_decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = []
    for i in range(length // chunk):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out.append(q_decayed[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new
    return torch.stack(out, dim=2).reshape(n, h, length, v.shape[-1]), state


def chunk_ssd(x_THP: torch.Tensor, dt_TH: torch.Tensor, A_H: torch.Tensor, B_TGS: torch.Tensor,
              C_TGS: torch.Tensor, cu_seqlens, initial_state_NHPS: torch.Tensor | None = None, *,
              D_H: torch.Tensor | None = None, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2 SSD over segments, each from its own initial state: ``(y_THP, final_NHPS)``.

    Per head, with the state h (P, S): ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t + D
    x_t`` (transformers' ``mamba2_chunk_scan``, mamba_ssm's ``mamba_chunk_scan_combined``).

    Args:
        x_THP: inputs, (T, H, P); any float dtype.
        dt_TH: time steps, (T, H), > 0: already through the layer's bias, softplus and clamp.
        A_H: (H,) decay rates, < 0 (``-exp(A_log)``).
        B_TGS: input projections, (T, G, S), ``H % G == 0``: head h reads group ``h // (H // G)``.
        C_TGS: output projections, (T, G, S).
        cu_seqlens: (N + 1,) int segment offsets (list or tensor), 0 first.
        initial_state_NHPS: (N, H, P, S) state before each segment; None: zeros.
        D_H: (H,) skip connection, or None.
        chunk_size: tokens per chunk.

    Returns y (T, H, P) in x's dtype and the state after each segment (N, H, P, S) in the compute dtype.
    """
    num_heads = x_THP.shape[1]
    dtype = compute_dtype(x_THP.dtype)
    B, C = _repeat_groups(B_TGS, C_TGS, num_heads, dtype, rule="B and C must be (T, G, S) alike with H % G == 0",
                          names=("B", "C"), heads="heads")
    x, dt, A = x_THP.to(dtype), dt_TH.to(dtype), A_H.to(dtype)
    bounds = _segments(cu_seqlens, x.shape[0])
    padding = _Padding(bounds, chunk_size, x.device)
    state = _initial(initial_state_NHPS, (padding.num_segments, num_heads, x.shape[2], B.shape[2]), x)
    if padding.num_segments == 0:
        return x_THP, state
    y, state = _ssd_chunks(padding.pad(x), padding.pad(dt), padding.pad(B), padding.pad(C), A, state, chunk_size)
    y = padding.unpad(y)
    if D_H is not None:
        y = y + D_H.to(dtype)[:, None] * x
    return y.to(x_THP.dtype), state


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """(..., c) -> (..., c, c): ``sum(a[j+1 : i+1])`` for j <= i, -inf above the diagonal (no cancellation)."""
    chunk = a.shape[-1]
    a = a[..., None].expand(*a.shape, chunk)
    a = a.masked_fill(~torch.ones(chunk, chunk, dtype=torch.bool, device=a.device).tril(-1), 0)
    out = a.cumsum(-2)
    return out.masked_fill(~torch.ones(chunk, chunk, dtype=torch.bool, device=a.device).tril(0), float("-inf"))


def _ssd_chunks(x, dt, B, C, A, state, chunk: int):
    """x: (N, L, H, P); dt: (N, L, H); B, C: (N, L, H, S); A: (H,); state: (N, H, P, S)."""
    n, length, h, p = x.shape
    x, B, C = (t.reshape(n, length // chunk, chunk, h, t.shape[-1]) for t in (x * dt[..., None], B, C))
    a = (A * dt).reshape(n, length // chunk, chunk, h).permute(0, 3, 1, 2)  # (N, H, c, chunk)
    cum = a.cumsum(-1)
    # inside each chunk: y_l = sum_{s <= l} exp(a_{s+1} + ... + a_l) (C_l . B_s) dt_s x_s
    pair_decay = _segment_sum(a).exp()  # (N, H, c, l, s)
    y = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", C, B, pair_decay, x)
    # each chunk's own contribution to the state at its end, then the scan over chunks
    to_end = (cum[..., -1:] - cum).exp()
    contribution = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, to_end, x)
    chunk_decay = cum[..., -1].exp()[..., None, None]  # (N, H, c, 1, 1)
    starts = []
    for i in range(length // chunk):
        starts.append(state)
        state = state * chunk_decay[:, :, i] + contribution[:, i]
    y = y + torch.einsum("bclhn,cbhpn,bhcl->bclhp", C, torch.stack(starts), cum.exp())
    return y.reshape(n, length, h, p), state


def causal_conv1d(x_TF: torch.Tensor, weight_FW: torch.Tensor, bias_F: torch.Tensor | None, cu_seqlens,
                  tails_NWF: torch.Tensor | None = None, activation: str | None = "silu", *,
                  kernel=None) -> torch.Tensor:
    """Depthwise causal convolution of each segment, continuing its tail: ``y_TF`` in x's dtype.

    Args:
        x_TF: inputs, (T, F).
        weight_FW: (F, W) filters (``nn.Conv1d(F, F, W, groups=F).weight.squeeze(1)``).
        bias_F: (F,) or None.
        cu_seqlens: (N + 1,) int segment offsets, 0 first.
        tails_NWF: (N, W - 1, F): the W - 1 inputs before each segment (zeros at a document's start); None:
            zeros everywhere.
        activation: ``"silu"`` or None.
        kernel: a library's causal convolution ``kernel(x_LF, weight_FW, bias_F) -> y_LF`` of one sequence
            in x's dtype, before the activation (``backends.conv_kernel``); None: ``F.conv1d`` in the
            promoted dtype.

    Token t of a segment gets ``bias + sum_j weight[:, j] * x[t - (W-1) + j]``, reading the tail for
    positions before the segment (transformers' ``causal_conv1d_fn`` with a conv state).
    """
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    bounds = _segments(cu_seqlens, x_TF.shape[0])
    num_segments, width = len(bounds) - 1, weight_FW.shape[1]
    tails = x_TF.new_zeros((num_segments, width - 1, x_TF.shape[1])) if tails_NWF is None else tails_NWF
    if tuple(tails.shape) != (num_segments, width - 1, x_TF.shape[1]):
        raise ValueError(f"the tails have shape {tuple(tails.shape)}, need {(num_segments, width - 1, x_TF.shape[1])}")
    # one sequence [tail 0, segment 0, tail 1, segment 1, ...]: a valid convolution over it reads, for each
    # token, only its own segment and tail
    dtype = torch.promote_types(x_TF.dtype, weight_FW.dtype)
    if x_TF.shape[0] == 0:  # no tokens: an empty output, still in the graph of the filters
        y = x_TF.to(dtype) * weight_FW[:, 0].to(dtype)
        return (y if bias_F is None else y + bias_F.to(dtype)).to(x_TF.dtype)
    starts, lengths = torch.tensor(bounds[:-1], dtype=torch.int64), torch.tensor(bounds, dtype=torch.int64).diff()
    segment = torch.arange(num_segments)
    token_rows = torch.arange(bounds[-1]) + (torch.repeat_interleave(segment, lengths) + 1) * (width - 1)
    tail_rows = (starts + segment * (width - 1))[:, None] + torch.arange(width - 1)
    extended = x_TF.new_zeros((bounds[-1] + num_segments * (width - 1), x_TF.shape[1]))
    extended = extended.index_copy(0, token_rows.to(x_TF.device), x_TF)
    extended = extended.index_copy(0, tail_rows.reshape(-1).to(x_TF.device),
                                   tails.reshape(-1, x_TF.shape[1]).to(x_TF.dtype))
    if kernel is not None:  # a library's causal convolution of the whole sequence
        y = kernel(extended, weight_FW, bias_F).index_select(0, token_rows.to(x_TF.device))
        return (F.silu(y) if activation == "silu" else y).to(x_TF.dtype)
    y = F.conv1d(extended.to(dtype).T[None], weight_FW.to(dtype)[:, None, :],
                 None if bias_F is None else bias_F.to(dtype), groups=x_TF.shape[1])[0].T
    y = y.index_select(0, token_rows.to(x_TF.device) - (width - 1))
    return (F.silu(y) if activation == "silu" else y).to(x_TF.dtype)
