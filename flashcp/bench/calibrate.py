"""``flashcp bench --calibrate``: measure a device's attention curve and overheads, and write a profile.

The measured parts replace the profile's attention curve (forward and backward TFLOP/s by sequence length,
``flashcp.bench.measure.attention_curve``), the per-call and per-sequence overheads and the copy
bandwidth. What one
device cannot measure (the link between GPUs, collective latency, peak) is kept from the base profile, and
its source sentence says so. The profile's ``name`` and every replaced ``source`` record the device, the
kernel backend, torch's version and the date.
"""

from __future__ import annotations

import datetime
from dataclasses import replace
from pathlib import Path

import torch

from flashcp.bench.measure import attention_curve, copy_bandwidth, kernel_overhead, sequence_overhead
from flashcp.costmodel.profile import HardwareProfile, load_profile
from flashcp.costmodel.shape import AttentionShape
from flashcp.errors import FlashcpError
from flashcp.outputs import OutputKind, write_json_output
from flashcp.runtime.kernels import resolve_backend

__all__ = ["GPU_LENGTHS", "PROFILE_OUTPUT", "calibrate_profile", "device_name", "save_profile"]

GPU_LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
"""Sequence lengths the GPU curve is measured at."""


def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` on a GPU, ``cpu`` otherwise."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def calibrate_profile(base: HardwareProfile, device: torch.device, *, dtype: torch.dtype | None = None,
                      shape: AttentionShape | None = None, lengths=GPU_LENGTHS, total_tokens: int = 32768,
                      backend: str = "auto", reps: int = 3) -> HardwareProfile:
    """``base`` with its attention curve, kernel overhead and copy bandwidth measured on ``device``.

    Defaults: bf16 with 16 heads of 128 (the published benchmarks' shape) on a GPU; pass ``dtype``,
    ``shape`` and ``lengths`` for other devices (the CPU runtime scenario calibrates float32 ``reference``).
    """
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    shape = shape or AttentionShape(num_heads=16, num_kv_heads=16, head_dim=128)
    probe = torch.zeros(1, shape.num_heads, shape.head_dim, device=device, dtype=dtype)
    backend = resolve_backend(backend, probe)
    overhead_s = kernel_overhead(shape, device, dtype, backend)
    per_sequence_s = sequence_overhead(shape, device, dtype, backend)
    dense = backend == "reference"  # scaled_dot_product_attention with a mask computes every pair
    curve = attention_curve(lengths, shape, device, dtype, backend, total_tokens, reps, per_sequence_s, dense)
    copy_gbps = copy_bandwidth(device, num_bytes=1 << (28 if device.type == "cuda" else 24)) / 1e9
    where = (f"{device_name(device)}, backend {backend}, {str(dtype).removeprefix('torch.')}, "
             f"H={shape.num_heads} D={shape.head_dim}, torch {torch.__version__}, "
             f"{datetime.date.today().isoformat()}")
    measured = f"measured by flashcp bench --calibrate on {where}"
    sources = dict(base.sources)
    sources["attention_tflops"] = (f"{measured}: one varlen call per length over "
                                   f"max(1, {total_tokens} // length) causal sequences of that length"
                                   + ("; FLOPs count the whole length x length square" if dense else ""))
    sources["attention_tflops.extrapolation"] = (
        "below the first length the first segment's power law continues; above the last, the last value "
        "holds; never above peak_tflops")
    sources["kernel_overhead_us"] = f"{measured}: forward + backward of a one-token call, halved"
    sources["sequence_overhead_us"] = (f"{measured}: a call over 64 one-token sequences against a call over "
                                       "one, per extra sequence and pass")
    tile = base.query_tile
    if dense:  # scaled_dot_product_attention per shard: no query tiles to pad, no masked pairs skipped
        tile = 1
        sources["query_tile"] = "the reference backend computes each shard's queries exactly (no tiles)"
        sources["causal_skip"] = ("the reference backend (scaled_dot_product_attention with an explicit "
                                  "mask) computes every query-key pair of a shard's rectangle")
    sources["hbm_gbps"] = f"{measured}: index_select of rows, bytes read + written"
    for name in ("peak_tflops", "link_gbps", "collective_latency_us", *(("query_tile",) if tile > 1 else ())):
        kept = f"kept from '{base.name}' (not measurable on one device): "
        sources[name] = kept + base.sources.get(name, "")
    return replace(base, name=f"calibrated on {where}", calibrated=True,
                   lengths=tuple(curve["lengths"]), forward_tflops=tuple(curve["forward"]),
                   backward_tflops=tuple(curve["backward"]), kernel_overhead_us=overhead_s * 1e6,
                   sequence_overhead_us=per_sequence_s * 1e6, query_tile=tile, causal_skip=not dense,
                   hbm_gbps=copy_gbps, sources=sources)


def _is_profile(path: Path) -> bool:
    try:
        load_profile(path)
    except FlashcpError:
        return False
    return True


PROFILE_OUTPUT = OutputKind(what="a flashcp hardware profile", option="--profile-out", recognise=_is_profile)
"""``flashcp bench --calibrate --profile-out FILE``: a file ``load_profile`` reads."""


def save_profile(profile: HardwareProfile, path: str | Path) -> None:
    """Write ``profile`` to ``path`` atomically, in the format ``load_profile`` reads (``flashcp.outputs`` rules)."""
    write_json_output(path, PROFILE_OUTPUT, profile.to_json())
