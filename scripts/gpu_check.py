"""GPU timing of the runtime: one rank's attention per strategy in the paper's setting.

Run ``scripts/gpu_check.sh`` from the repository root: it first runs the ``gpu``-marked tests (does the
runtime work on this device: each backend's ring and LSE kernels, ``auto``'s choice, bf16 accuracy against
float64, the host syncs of a training step; tests/runtime/test_gpu_runtime.py and test_kernels_gpu.py), then
this script. Needs only the repo and torch; FA3 (``flash_attn_interface``), FA4 (``flash_attn.cute``) and FA2
(``flash_attn``) are used when installed. ``--out DIR`` (the shell script passes ``$OUT``) also writes the
report there.

It prints the versions (torch, the device, the flash-attention packages), then times the paper's setting
(C=131072, cp 8, H=32, H_kv=8, D=128, bf16) on ``wlb`` and ``pile`` length distributions, for each strategy
found in ``flashcp.planner.registry``, with comm ``auto``; then the two ring
baselines with comm ``ring``: Ring-Attn (``ring`` layout, from ``flashcp.planner.strategies.baselines``) and
Ring-Attn zigzag (the ``perdoc`` strategy's layout, when present), each rank timed over every block
(``ring_attention_from_blocks``: the ring's step kernels and merges, no transfers). Each CP rank is emulated on
the one GPU: its meta is built from the plan, it gets the receive buffer its exchange would deliver, and
``attention_after_exchange`` (the code ``cp_attention`` runs after the collective) is timed forward + backward.

``--device cpu --small`` runs the same code paths at toy size on the CPU (reference backend) as a smoke test.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flashcp.costmodel.workload import rank_workloads  # noqa: E402
from flashcp.outputs import OutputKind, check_script_output, json_report, write_json_output  # noqa: E402
from flashcp.planner.plan import SequencePlan  # noqa: E402
from flashcp.planner.strategies.baselines import ring_plan  # noqa: E402
from flashcp.runtime import kernels  # noqa: E402
from flashcp.runtime.attention import attention_after_exchange  # noqa: E402
from flashcp.runtime.meta import COMM_MODES, build_rank_metas  # noqa: E402
from flashcp.runtime.ring import ring_attention_from_blocks  # noqa: E402


def _starts_like_a_report(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(6) == b"torch "  # the versions line that every report opens with
    except OSError:
        return False


REPORT_JSON = json_report("flashcp-gpu-check", "a scripts/gpu_check.py report", option="--out",
                          legacy=lambda value: {"works", "pass"} <= set(value))
REPORT_TEXT = OutputKind(what="a scripts/gpu_check.py report", option="--out", recognise=_starts_like_a_report)
"""``--out DIR`` replaces only these two files of an earlier check (flashcp.outputs: never a user's file)."""


# ---------------------------------------------------------------- sequences and plans

def doc_length_sampler(dist: str, rng: np.random.Generator):
    """``sample(n) -> lengths`` for ``wlb`` (the shipped WLB-LLM lengths) or ``pile``.

    ``pile`` uses ``flashcp.data.synth`` when it provides a sampler; otherwise a log-normal stand-in
    (median 1024 tokens, sigma 1.4: mostly short documents), reported as ``pile~``.
    """
    try:
        synth = importlib.import_module("flashcp.data.synth")
        sampler = getattr(synth, "doc_length_sampler", None)
        if sampler is not None:
            return dist, sampler(dist, rng)
    except ImportError:
        pass
    if dist == "wlb":
        lengths = np.array(json.loads((ROOT / "flashcp/data/dists/wlb.json").read_text()), dtype=np.int64)
        return "wlb", lambda n: rng.choice(lengths, size=n)
    return "pile~", lambda n: np.maximum(1, rng.lognormal(math.log(1024), 1.4, size=n)).astype(np.int64)


def pack(sample, context_len: int) -> np.ndarray:
    """Documents drawn until the context is full; the last one is cut to fit."""
    lens, total = [], 0
    while total < context_len:
        for n in sample(64):
            n = int(min(max(n, 1), context_len - total))
            lens.append(n)
            total += n
            if total == context_len:
                break
    return np.array(lens, dtype=np.int64)


def strategy_planners() -> dict:
    """Name -> ``plan(doc_lens, cp) -> SequencePlan`` for each strategy the planner provides."""
    from flashcp.planner.planning import plan_sequence
    from flashcp.planner.registry import STRATEGIES as names

    return {name: (lambda doc_lens, cp, name=name: plan_sequence(name, doc_lens, cp)) for name in names}


def versions(device) -> None:
    """torch, the device and the attention libraries installed (by their package metadata)."""
    from importlib import metadata

    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        where = f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}, CUDA {torch.version.cuda})"
    else:
        where = "cpu"
    found = []
    for package in ("flash-attn", "flash_attn_3", "flash-attn-3", "flash-attn-4"):
        try:
            found.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            continue
    print(f"torch {torch.__version__}, device {where}; {', '.join(found) or 'no flash-attention package'}")


# ---------------------------------------------------------------- timing

def time_rank(meta, backend, device, heads, kv_heads, head_dim, reps, comm="auto"):
    """Median ms of one rank's attention forward + backward after its exchange (random bf16 inputs).

    With ``comm="ring"``: over every rank's block, step by step (the ring's kernels and merges).
    """
    t = meta.num_tokens
    q = torch.randn(t, heads, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(t, kv_heads, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    grad = torch.randn_like(q)
    meta = meta.to(device)
    if comm == "ring":
        blocks = [torch.randn(2, rows, kv_heads, head_dim, device=device, dtype=torch.bfloat16,
                              requires_grad=True) for rows in meta.ring.block_rows]

        def run():
            return ring_attention_from_blocks(q, blocks, meta.ring, backend)
    else:
        recv = torch.randn(meta.exchange(comm).recv_rows, 2, kv_heads, head_dim, device=device,
                           dtype=torch.bfloat16, requires_grad=True)

        def run():
            return attention_after_exchange(q, k, v, recv, meta, comm, backend)
    times = []
    for i in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = run()
        out.backward(grad)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first run warms up
            times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def timing(device, small: bool, budget_s: float, num_seqs: int) -> None:
    context_len, cp, heads, kv_heads, head_dim = (256, 4, 4, 2, 16) if small else (131072, 8, 32, 8, 128)
    probe = torch.zeros(1, heads, head_dim, device=device, dtype=torch.bfloat16)
    backend = kernels.resolve_backend("auto", probe, blockwise=True)
    if backend == "reference" and not small:
        backend = None
    print(f"\ntiming: C={context_len} cp={cp} H={heads} H_kv={kv_heads} D={head_dim} bf16, one rank's "
          f"attention fwd+bwd after its exchange (comm auto; the ring rows: ring), backend {backend}, "
          f"{num_seqs} sequences per dataset")
    if backend is None:
        print("  skipped: no GPU attention backend is available (see the gpu-marked tests)")
        return
    planners = strategy_planners()
    if not planners:
        return
    deadline = time.monotonic() + budget_s
    print(f"  {'data':<6} {'strategy':<12} {'imbal':>6} {'shards':>7} {'max ms':>8} {'mean ms':>8} "
          f"{'min ms':>8} {'slowest/mean':>12}  max K/V tokens in per rank: allgather / a2a / full / ring")
    runs = [(name, plan_fn, "auto") for name, plan_fn in planners.items()]
    runs.append(("ring+ring", ring_plan, "ring"))
    if "perdoc" in planners:
        runs.append(("perdoc+ring", planners["perdoc"], "ring"))
    for dist in ("wlb", "pile"):
        rng = np.random.default_rng(1)
        label, sample = doc_length_sampler(dist, rng)
        sequences = [pack(sample, context_len) for _ in range(num_seqs)]
        for name, plan_fn, comm in runs:
            if time.monotonic() > deadline:
                print(f"  {label:<6} {name:<12} skipped: time budget of {budget_s:.0f} s used up")
                continue
            try:
                rows = [measure(plan_fn(doc_lens, cp), doc_lens, backend, device, heads, kv_heads, head_dim,
                                comm=comm) for doc_lens in sequences]
            except Exception as e:
                print(f"  {label:<6} {name:<12} skipped: {type(e).__name__}: {e}")
                continue
            mean = {key: float(np.mean([r[key] for r in rows])) for key in rows[0]}
            print(f"  {label:<6} {name:<12} {mean['imbalance']:>6.3f} {mean['shards']:>7.0f} "
                  f"{mean['max']:>8.2f} {mean['mean']:>8.2f} {mean['min']:>8.2f} "
                  f"{mean['max'] / mean['mean']:>12.3f}  "
                  f"{mean['allgather']:>9.0f} / {mean['a2a']:>6.0f} / {mean['full']:>6.0f} / "
                  f"{mean['ring']:>6.0f}")


def measure(plan: SequencePlan, doc_lens, backend, device, heads, kv_heads, head_dim, reps=3,
            comm="auto") -> dict:
    plan.validate(doc_lens)
    metas = build_rank_metas(plan, doc_lens)
    ms = [time_rank(m, backend, device, heads, kv_heads, head_dim, reps, comm) for m in metas]
    work = rank_workloads(plan.shard_start, plan.shard_len, plan.shard_rank, plan.cp)
    return {"imbalance": float(work.max() / work.mean()), "shards": plan.num_shards, "max": max(ms),
            "mean": float(np.mean(ms)), "min": min(ms),
            **{mode: max(m.wire_tokens(mode)[1] for m in metas) for mode in COMM_MODES}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="GPU timing of one rank's attention per strategy.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="toy sizes (CPU smoke test)")
    parser.add_argument("--seqs", type=int, default=2, help="sequences per dataset for timing")
    parser.add_argument("--budget", type=float, default=150.0, help="seconds allowed for the timing part")
    parser.add_argument("--out", type=Path, help="also write the report to OUT/gpu_check.txt (and a json)")
    args = parser.parse_args(argv)
    if args.out:  # before the work, not after it
        check_script_output(args.out / "gpu_check.txt", REPORT_TEXT)
        check_script_output(args.out / "gpu_check.json", REPORT_JSON)
    device = torch.device(args.device)
    if device.type == "cpu" and not args.small:
        print("no CUDA device: the GPU backends cannot run; use --small for a CPU smoke test")
        return 1
    report = _Tee(args.out / "gpu_check.txt" if args.out else None)
    started = time.monotonic()
    try:
        versions(device)
        timing(device, args.small, args.budget, args.seqs)
        print(f"\ndone ({time.monotonic() - started:.0f} s)")
    finally:
        report.close()
    if args.out:
        write_json_output(args.out / "gpu_check.json", REPORT_JSON,
                          {"format": "flashcp-gpu-check", "seconds": time.monotonic() - started})
    return 0


class _Tee:
    """Print to stdout and, when given a path, to that file too (created with its folder)."""

    def __init__(self, path: Path | None):
        self.stdout, self.file = sys.stdout, None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = path.open("w")
            sys.stdout = self

    def write(self, text: str) -> int:
        self.stdout.write(text)
        if self.file is not None:
            self.file.write(text)
        return len(text)

    def flush(self) -> None:
        self.stdout.flush()
        if self.file is not None:
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            sys.stdout = self.stdout
            self.file.close()


if __name__ == "__main__":
    sys.exit(main())
