"""GPU check of the runtime: kernel accuracy in bf16, then one rank's attention time per strategy.

Run ``bench/gpu_check.sh`` (or ``python bench/gpu_check.py``) from the repository root. Needs only the repo
and torch; flash-attn is used when installed. Each CP rank is emulated on the one GPU: its meta is built from
the plan, it gets the receive buffer its exchange would deliver, and ``attention_after_exchange`` (the same
code ``cp_attention`` runs after the collective) is timed forward + backward.

1. Accuracy: for every GPU backend, a whole sequence run through the emulated CP path in bf16 is compared
   with a float64 dense document-masked reference; its max error (out, dq, dk, dv) must be at most twice
   that of a plain-PyTorch bf16 dense implementation (+1e-5), as flash-attention's own tests require.
2. Timing: the paper's setting (C=131072, cp 8, H=32, H_kv=8, D=128, bf16) on ``wlb`` and ``pile`` length
   distributions, for each strategy found in ``flashcp.planner.strategies`` (missing ones are skipped), with
   comm ``auto``; then the two ring baselines with comm ``ring``: Ring-Attn (``ring`` layout, from
   ``flashcp.planner.ring``) and Ring-Attn zigzag (the ``perdoc`` strategy's layout, when present), each rank
   timed over every block (``ring_attention_from_blocks``: the ring's step kernels and merges, no transfers).

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

from flashcp.planner.cost import rank_workloads  # noqa: E402
from flashcp.planner.plan import SequencePlan  # noqa: E402
from flashcp.planner.ring import ring_plan  # noqa: E402
from flashcp.runtime.attention import attention_after_exchange  # noqa: E402
from flashcp.runtime.emulate import emulate_cp_attention, random_plan  # noqa: E402
from flashcp.runtime.kernels import backend_available  # noqa: E402
from flashcp.runtime.meta import COMM_MODES, build_rank_metas  # noqa: E402
from flashcp.runtime.ring import ring_attention_from_blocks  # noqa: E402

GPU_BACKENDS = ("torch_varlen", "flash_attn")
STRATEGIES = ("llama3", "perdoc", "flashcp")


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
    """name -> ``plan(doc_lens, cp) -> SequencePlan`` for each strategy the planner provides."""
    try:
        strategies = importlib.import_module("flashcp.planner.strategies")
    except ImportError as e:
        print(f"  skipping all strategies: flashcp.planner.strategies is not available ({e})")
        return {}
    plan_sequence = getattr(strategies, "plan_sequence", None)
    if plan_sequence is None:
        print("  skipping all strategies: flashcp.planner.strategies has no "
              "plan_sequence(strategy, doc_lens, cp)")
        return {}
    names = list(getattr(strategies, "STRATEGIES", STRATEGIES))
    return {name: (lambda doc_lens, cp, name=name: plan_sequence(name, doc_lens, cp)) for name in names}


# ---------------------------------------------------------------- accuracy

def dense_attention(q, k, v, doc_lens):
    """Plain PyTorch: dense scores over the whole sequence with a document-causal mask, in q's dtype."""
    context_len, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    doc = torch.repeat_interleave(torch.arange(len(doc_lens), device=q.device),
                                  torch.as_tensor(doc_lens, device=q.device))
    pos = torch.arange(context_len, device=q.device)
    keep = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    scores = torch.einsum("ihd,jhd->hij", q, k.repeat_interleave(group, 1)) / math.sqrt(head_dim)
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    return torch.einsum("hij,jhd->ihd", probs, v.repeat_interleave(group, 1))


def errors_against(fn, inputs64, grad64, dtype):
    """Max |error| of (out, dq, dk, dv) of ``fn`` run in ``dtype`` against the float64 results."""
    inputs = [t.detach().to(dtype).requires_grad_() for t in inputs64[:3]]
    out = fn(*inputs)
    out.backward(grad64.to(dtype))
    got = [out] + [t.grad for t in inputs]
    return [(a.double() - b).abs().max().item() for a, b in zip(got, inputs64[3])]


def accuracy_check(device, small: bool) -> bool:
    context_len, cp, heads, kv_heads, head_dim = (96, 4, 4, 2, 16) if small else (4096, 4, 8, 2, 128)
    rng = np.random.default_rng(0)
    if small:
        doc_lens = np.array([40, 1, 30, 25])
    else:
        doc_lens = pack(doc_length_sampler("wlb", rng)[1], context_len)
    if doc_lens.max() < context_len // 3:  # make sure one document spans several ranks
        doc_lens = np.r_[context_len // 2, pack(doc_length_sampler("pile", rng)[1], context_len // 2)]
    plan = random_plan(doc_lens, cp, rng, max_pieces=6, cut_prob=2.0 / context_len)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad = (torch.randn(context_len, h, head_dim, dtype=torch.float64, device=device, generator=gen)
                     for h in (heads, kv_heads, kv_heads, heads))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = dense_attention(*leaves, doc_lens)
    ref.backward(grad)
    reference = (q, k, v, [ref.detach()] + [t.grad for t in leaves])
    print(f"accuracy: C={context_len} cp={cp} H={heads} H_kv={kv_heads} D={head_dim} bf16, "
          f"{doc_lens.size} documents, {plan.num_shards} shards (random plan, shortest "
          f"{plan.shard_len.min()}); max |error| vs float64")
    plain = errors_against(lambda q, k, v: dense_attention(q, k, v, doc_lens), reference, grad,
                           torch.bfloat16)
    print(f"  {'implementation':<28} {'out':>9} {'dq':>9} {'dk':>9} {'dv':>9}  verdict")
    print(f"  {'plain PyTorch bf16 (dense)':<28} " + " ".join(f"{e:>9.2e}" for e in plain) + "  baseline")
    ok = True
    backends = GPU_BACKENDS + (("reference",) if small else ())
    for backend in backends:
        probe = q[:1].to(torch.bfloat16)
        if not backend_available(backend, probe):
            print(f"  {backend:<28} skipped: not available here")
            continue
        for comm in COMM_MODES:
            name = f"{backend} ({comm})"
            try:
                errs = errors_against(lambda q, k, v, b=backend, c=comm: emulate_cp_attention(
                    q, k, v, plan, doc_lens, c, b), reference, grad, torch.bfloat16)
            except Exception as e:  # report and go on: one broken backend must not hide the others
                print(f"  {name:<28} FAILED to run: {type(e).__name__}: {e}")
                ok = False
                continue
            passed = all(e <= 2 * p + 1e-5 for e, p in zip(errs, plain))
            ok &= passed
            print(f"  {name:<28} " + " ".join(f"{e:>9.2e}" for e in errs) + ("  ok" if passed else "  FAIL"))
    return ok


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
    backend = next((b for b in GPU_BACKENDS[::-1] if backend_available(b, probe)), None)
    if backend is None and small:
        backend = "reference"
    print(f"\ntiming: C={context_len} cp={cp} H={heads} H_kv={kv_heads} D={head_dim} bf16, one rank's "
          f"attention fwd+bwd after its exchange (comm auto; the ring rows: ring), backend {backend}, "
          f"{num_seqs} sequences per dataset")
    if backend is None:
        print("  skipped: no GPU attention backend is available (torch_varlen needs CUDA, flash_attn is "
              "optional)")
        return
    planners = strategy_planners()
    if not planners and small:  # still exercise the timing path in the smoke test
        planners = {"random": lambda doc_lens, cp: random_plan(doc_lens, cp, np.random.default_rng(0))}
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
    parser = argparse.ArgumentParser(description="GPU check of the runtime kernels and per-rank timing.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="toy sizes (CPU smoke test)")
    parser.add_argument("--seqs", type=int, default=2, help="sequences per dataset for timing")
    parser.add_argument("--budget", type=float, default=150.0, help="seconds allowed for the timing part")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    started = time.monotonic()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, device {name}")
    if device.type == "cpu" and not args.small:
        print("no CUDA device: the GPU backends cannot run; use --small for a CPU smoke test")
        return 1
    ok = accuracy_check(device, args.small)
    timing(device, args.small, args.budget, args.seqs)
    print(f"\n{'PASS' if ok else 'FAIL'} ({time.monotonic() - started:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
