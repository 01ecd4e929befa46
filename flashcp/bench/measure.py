"""Timing the real attention code on one device: one rank's parts, and the kernel curve for a profile.

``time_rank_parts`` runs what ``cp_attention`` runs on a rank after (and while) its exchange, split the way
the projection splits it: the local part's forward, the remote part's forward (over ``cat(local K/V,
receive buffer)``, the buffer filled with random values of the right shape), then the remote and the local
backward. Every rank of a plan can be timed this way on one GPU (``measured_work``), which is how
``flashcp bench --measured`` replaces projected attention times with measured ones.

``attention_curve`` times ``varlen_attention`` over batches of equal-length causal sequences (the layout of
the published FlashAttention benchmarks the default profile cites), forward and backward, and
``kernel_overhead`` / ``sequence_overhead`` / ``copy_bandwidth`` time a one-token call, many one-token
sequences in one call, and a large gather; ``flashcp.bench.calibrate``
turns them into a profile.

Shape legend: ``T`` tokens of a rank, ``H`` query heads, ``K`` key/value heads, ``D`` head dim, ``R`` rows of
the receive buffer.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from flashcp.costmodel.profile import HardwareProfile
from flashcp.costmodel.projection import RankWork, comm_volumes, resolve_comm
from flashcp.costmodel.shape import AttentionShape
from flashcp.planner.plan import SequencePlan
from flashcp.runtime.attention import local_attention, remote_attention
from flashcp.runtime.kernels import varlen_attention
from flashcp.runtime.meta import CPAttnMeta, build_rank_metas

__all__ = ["attention_curve", "copy_bandwidth", "kernel_overhead", "measured_work", "sequence_overhead",
           "time_rank_parts"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    started = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - started


def time_rank_parts(meta: CPAttnMeta, comm: str, shape: AttentionShape, device: torch.device, dtype: torch.dtype,
                    backend: str = "auto", reps: int = 3) -> dict[str, float]:
    """Median seconds of ``local_fwd``, ``remote_fwd``, ``remote_bwd``, ``local_bwd`` of one rank.

    Inputs are random: q (T, H, D), k and v (T, K, D), the receive buffer (R, 2, K, D) of ``comm``'s
    exchange. The first of ``reps + 1`` runs warms up and is not counted.
    """
    meta = meta.to(device)
    exchange = meta.exchange(comm)
    t = meta.num_tokens
    gen = torch.Generator(device=device).manual_seed(meta.rank)

    def leaf(*size):
        return torch.randn(*size, device=device, dtype=dtype, generator=gen).requires_grad_()

    q, k, v = leaf(t, shape.num_heads, shape.head_dim), *(leaf(t, shape.num_kv_heads, shape.head_dim)
                                                          for _ in range(2))
    recv = leaf(exchange.recv_rows, 2, shape.num_kv_heads, shape.head_dim)
    times: dict[str, list[float]] = {"local_fwd": [], "remote_fwd": [], "remote_bwd": [], "local_bwd": []}
    for run in range(reps + 1):
        outs = {}

        def forward(part):
            if part == "local":
                outs[part] = local_attention(q, k, v, meta, backend)
            else:
                outs[part] = remote_attention(q, k, v, recv, meta, exchange, backend)

        def backward(part):
            out = outs[part]
            if out.shape[0] and out.requires_grad:
                out.backward(torch.ones_like(out))

        took = {"local_fwd": _timed(lambda: forward("local"), device),
                "remote_fwd": _timed(lambda: forward("remote"), device),
                "remote_bwd": _timed(lambda: backward("remote"), device),
                "local_bwd": _timed(lambda: backward("local"), device)}
        for tensor in (q, k, v, recv):
            tensor.grad = None
        if run:
            for name, seconds in took.items():
                times[name].append(seconds)
    return {name: float(np.median(values)) for name, values in times.items()}


def measured_work(plan: SequencePlan, doc_lens, shape: AttentionShape, profile: HardwareProfile, comm: str,
                  device: torch.device, dtype: torch.dtype = torch.bfloat16, backend: str = "auto",
                  reps: int = 2) -> RankWork:
    """RankWork of every rank of ``plan`` timed on ``device`` (all ranks one after another).

    The gathers run inside the timed parts; the send buffer and the output merge stay projected
    (``profile.hbm_gbps``).
    """
    mode = resolve_comm(comm, comm_volumes(plan), shape.dtype_bytes)
    metas = build_rank_metas(plan, doc_lens)
    parts = [time_rank_parts(m, mode, shape, device, dtype, backend, reps) for m in metas]
    column = {name: np.array([p[name] for p in parts]) for name in parts[0]}
    volumes = comm_volumes(plan)[mode]
    tokens = np.array([m.num_tokens for m in metas], dtype=np.float64)
    other = 2.0 * (volumes["send"] * shape.kv_row_bytes + 2.0 * tokens * shape.q_row_bytes) / (
        profile.hbm_gbps * 1e9)
    calls = np.array([2 * ((m.local.num_tokens > 0) + (m.remote.num_tokens > 0)) for m in metas])
    zeros = np.zeros(plan.cp)
    return RankWork(local_fwd=column["local_fwd"], remote_fwd=column["remote_fwd"],
                    local_bwd=column["local_bwd"], remote_bwd=column["remote_bwd"], local_copy=zeros,
                    remote_copy=zeros, other_copy=other, kernels=calls, measured=True)


def attention_curve(lengths, shape: AttentionShape, device: torch.device, dtype: torch.dtype,
                    backend: str = "auto", total_tokens: int = 16384, reps: int = 3,
                    sequence_overhead_s: float = 0.0, dense: bool = False) -> dict[str, list]:
    """Achieved forward and backward TFLOP/s of causal varlen attention at each sequence length.

    Each measurement is one call over ``max(1, total_tokens // length)`` sequences of ``length`` tokens;
    FLOPs are ``4 * pairs * H * D`` forward and 2.5x that backward (the profile's convention). The fixed
    cost of the call's sequences (``sequence_overhead_s`` each, per pass) is taken out first, as the
    projection adds it back per shard. ``dense`` counts every pair of the ``length x length`` square, for
    kernels that do not skip the masked triangle.
    """
    forward: list[float] = []
    backward: list[float] = []
    for length in lengths:
        batch = max(1, total_tokens // length)
        n = batch * length
        gen = torch.Generator(device=device).manual_seed(length)
        q = torch.randn(n, shape.num_heads, shape.head_dim, device=device, dtype=dtype, generator=gen)
        k, v = (torch.randn(n, shape.num_kv_heads, shape.head_dim, device=device, dtype=dtype, generator=gen)
                for _ in range(2))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        cu = torch.arange(batch + 1, device=device, dtype=torch.int32) * length
        pairs = length * length if dense else length * (length + 1) / 2
        flops = 4.0 * batch * pairs * shape.num_heads * shape.head_dim
        fwd_times, bwd_times = [], []
        for run in range(reps + 1):
            holder: dict[str, torch.Tensor] = {}
            fwd = _timed(lambda: holder.setdefault("out", varlen_attention(q, k, v, cu, cu, length, length,
                                                                           backend)), device)
            grad = torch.ones_like(holder["out"])
            bwd = _timed(lambda: holder["out"].backward(grad), device)
            q.grad = k.grad = v.grad = None
            if run:
                fwd_times.append(fwd)
                bwd_times.append(bwd)
        fixed = batch * sequence_overhead_s
        for times, out, scale in ((fwd_times, forward, 1.0), (bwd_times, backward, 2.5)):
            seconds = float(np.median(times))
            out.append(scale * flops / max(seconds - fixed, 0.05 * seconds) / 1e12)
    return {"lengths": [int(n) for n in lengths], "forward": forward, "backward": backward}


def kernel_overhead(shape: AttentionShape, device: torch.device, dtype: torch.dtype, backend: str = "auto",
                    reps: int = 20) -> float:
    """Median seconds of a forward + backward call over one 1-token sequence, halved (one call's cost)."""
    q = torch.randn(1, shape.num_heads, shape.head_dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, shape.num_kv_heads, shape.head_dim, device=device, dtype=dtype,
                        requires_grad=True) for _ in range(2))
    cu = torch.tensor([0, 1], device=device, dtype=torch.int32)

    def call():
        varlen_attention(q, k, v, cu, cu, 1, 1, backend).sum().backward()

    times = [_timed(call, device) for _ in range(reps + 1)][1:]
    return float(np.median(times)) / 2


def sequence_overhead(shape: AttentionShape, device: torch.device, dtype: torch.dtype, backend: str = "auto",
                      count: int = 64, reps: int = 5) -> float:
    """Seconds each extra sequence adds to a call (per pass): ``count`` one-token sequences against one."""
    def call_seconds(batch):
        q, k, v = (torch.randn(batch, heads, shape.head_dim, device=device, dtype=dtype, requires_grad=True)
                   for heads in (shape.num_heads, shape.num_kv_heads, shape.num_kv_heads))
        cu = torch.arange(batch + 1, device=device, dtype=torch.int32)

        def call():
            varlen_attention(q, k, v, cu, cu, 1, 1, backend).sum().backward()

        return float(np.median([_timed(call, device) for _ in range(reps + 1)][1:])) / 2

    return max(call_seconds(count) - call_seconds(1), 0.0) / (count - 1)


def copy_bandwidth(device: torch.device, num_bytes: int = 1 << 28, reps: int = 5) -> float:
    """Bytes per second of a row gather (``index_select``), counting each byte read and written once."""
    rows = num_bytes // 4096
    src = torch.empty(rows, 1024, device=device, dtype=torch.float32).uniform_()
    index = torch.randperm(rows, device=device)
    times = [_timed(lambda: src.index_select(0, index), device) for _ in range(reps + 1)][1:]
    return 2.0 * src.numel() * 4 / float(np.median(times))
