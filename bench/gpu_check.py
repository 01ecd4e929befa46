"""GPU check of the runtime, ordered so that the first minute answers "does it work".

Run ``bench/gpu_check.sh`` (or ``python bench/gpu_check.py``) from the repository root. Needs only the repo
and torch; FA3 (``flash_attn_interface``), FA4 (``flash_attn.cute``) and FA2 (``flash_attn``) are used when
installed. ``--out DIR`` (the shell script passes ``$OUT``) also writes the report there.

1. Does it work (seconds): the versions; each GPU backend's import and whether it can run bf16 at head dim
   128 (with the reason when not); ``auto``'s choice on a bf16 CUDA tensor, for the collectives and for the
   ring; the ring's forward and backward (the block-wise LSE kernels) through every available backend against
   float64; the log-sum-exp shapes at head dim 64 and 128 with all-length-1 query shards under GQA; two bf16
   training steps of a tiny model under ``torch.cuda.set_sync_debug_mode("warn")``, counting the host syncs
   of the second (flashcp's step makes one, its read after the optimizer step).
2. Accuracy: for every GPU backend and comm mode, a whole sequence run through the emulated CP path in bf16
   is compared with a float64 dense document-masked reference; its max error (out, dq, dk, dv) must be at
   most twice that of a plain-PyTorch bf16 dense implementation (+1e-5), as flash-attention's own tests do.
3. Timing: the paper's setting (C=131072, cp 8, H=32, H_kv=8, D=128, bf16) on ``wlb`` and ``pile`` length
   distributions, for each strategy found in ``flashcp.planner.registry`` (missing ones are skipped), with
   comm ``auto``; then the two ring baselines with comm ``ring``: Ring-Attn (``ring`` layout, from
   ``flashcp.planner.strategies.baselines``) and Ring-Attn zigzag (the ``perdoc`` strategy's layout, when
   present), each rank
   timed over every block (``ring_attention_from_blocks``: the ring's step kernels and merges, no transfers).
   Each CP rank is emulated on the one GPU: its meta is built from the plan, it gets the receive buffer its
   exchange would deliver, and ``attention_after_exchange`` (the code ``cp_attention`` runs after the
   collective) is timed forward + backward.

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
from flashcp.runtime.kernels import GPU_BACKENDS, backend_available  # noqa: E402
from flashcp.runtime.meta import COMM_MODES, build_rank_metas  # noqa: E402
from flashcp.runtime.ring import ring_attention_from_blocks  # noqa: E402
from tests.emulate import emulate_cp_attention, random_plan  # noqa: E402

STRATEGIES = ("llama3", "perdoc", "flashcp")


def _starts_like_a_report(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(6) == b"torch "  # the versions line that every report opens with
    except OSError:
        return False


REPORT_JSON = json_report("flashcp-gpu-check", "a bench/gpu_check.py report", option="--out",
                          legacy=lambda value: {"works", "pass"} <= set(value))
REPORT_TEXT = OutputKind(what="a bench/gpu_check.py report", option="--out", recognise=_starts_like_a_report)
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
    """name -> ``plan(doc_lens, cp) -> SequencePlan`` for each strategy the planner provides."""
    try:
        strategies = importlib.import_module("flashcp.planner.registry")
    except ImportError as e:
        print(f"  skipping all strategies: flashcp.planner.registry is not available ({e})")
        return {}
    plan_sequence = getattr(strategies, "plan_sequence", None)
    if plan_sequence is None:
        print("  skipping all strategies: flashcp.planner.registry has no "
              "plan_sequence(strategy, doc_lens, cp)")
        return {}
    names = list(getattr(strategies, "STRATEGIES", STRATEGIES))
    return {name: (lambda doc_lens, cp, name=name: plan_sequence(name, doc_lens, cp)) for name in names}


# ---------------------------------------------------------------- does it work

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


def blockwise_backends(probe) -> list[str]:
    return [b for b in GPU_BACKENDS if backend_available(b, probe, blockwise=True)] or ["reference"]


def check_ring(device, backend, small: bool) -> str:
    """The ring's forward and backward through ``backend`` against float64; '' when within bounds."""
    context_len, cp, heads, kv_heads, head_dim = (96, 3, 4, 2, 16) if small else (1024, 4, 8, 2, 128)
    rng = np.random.default_rng(1)
    doc_lens = np.r_[context_len // 2, pack(doc_length_sampler("pile", rng)[1], context_len - context_len // 2)]
    plan = random_plan(doc_lens, cp, rng, max_pieces=6, cut_prob=4.0 / context_len)
    reference = float64_reference(device, doc_lens, heads, kv_heads, head_dim, seed=2)
    plain = errors_against(lambda q, k, v: dense_attention(q, k, v, doc_lens), reference, reference[4],
                           torch.bfloat16)
    errs = errors_against(lambda q, k, v: emulate_cp_attention(q, k, v, plan, doc_lens, "ring", backend),
                          reference, reference[4], torch.bfloat16)
    if all(e <= 2 * p + 1e-5 for e, p in zip(errs, plain)):
        return ""
    return f"max |error| of out, dq, dk, dv {[f'{e:.2e}' for e in errs]} above 2x plain bf16 {plain}"


def check_lse_shapes(device, backend, head_dim: int) -> str:
    """Length-1 query shards under GQA: (T, H) float32 LSE equal to float64's; '' when right."""
    heads, kv_heads, k_lens = 8, 2, [1, 3, 7, 2, 9, 5]
    gen = torch.Generator(device=device).manual_seed(3)
    q = torch.randn(len(k_lens), heads, head_dim, device=device, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(sum(k_lens), kv_heads, head_dim, device=device, generator=gen).to(torch.bfloat16)
            for _ in range(2))
    cu_q = torch.arange(len(k_lens) + 1, dtype=torch.int32, device=device)
    cu_k = torch.tensor(np.r_[0, np.cumsum(k_lens)], dtype=torch.int32, device=device)
    out, lse = kernels.varlen_attention_forward(q, k, v, cu_q, cu_k, 1, max(k_lens), True, backend)
    want = []
    for i, n in enumerate(k_lens):
        keys = k[int(np.sum(k_lens[:i])):][:n].double().repeat_interleave(heads // kv_heads, 1)
        want.append(torch.logsumexp(torch.einsum("hd,khd->hk", q[i].double(), keys) / math.sqrt(head_dim), -1))
    if lse.shape != (len(k_lens), heads) or lse.dtype != torch.float32:
        return f"LSE of shape {tuple(lse.shape)} {lse.dtype}, expected ({len(k_lens)}, {heads}) float32"
    err = (lse.double() - torch.stack(want)).abs().max().item()
    grads = kernels.varlen_attention_backward(torch.ones_like(q), q, k, v, out, lse, cu_q, cu_k, 1, max(k_lens),
                                              True, backend)
    shapes = [tuple(g.shape) for g in grads] == [tuple(t.shape) for t in (q, k, v)]
    return "" if err < 1e-2 and shapes else f"LSE max |error| {err:.2e}, gradient shapes {[g.shape for g in grads]}"


def train_step_syncs(device, small: bool) -> tuple[int, str]:
    """Two bf16 training steps of a tiny model on one rank; the host syncs CUDA reports in the second."""
    import warnings

    from flashcp.models.tiny import TinyConfig, TinyDecoder
    from flashcp.runtime.loader import Batch
    from flashcp.runtime.meta import CPAttnMeta, rank_token_positions
    from flashcp.train import train_step

    doc_lens = np.array([30, 1, 15, 6] if small else [300, 1, 150, 61])
    dim = 32 if small else 256
    plan = random_plan(doc_lens, 1, np.random.default_rng(4))
    global_pos, doc_pos, doc = rank_token_positions(plan, doc_lens, 0)
    ids = torch.randint(0, 256, (int(doc_lens.sum()),))
    last = np.r_[doc[1:] != doc[:-1], True]
    labels = torch.where(torch.from_numpy(last), -100, torch.roll(ids, -1))
    batch = Batch(input_ids=ids, position_ids=torch.from_numpy(doc_pos), labels=labels,
                  attn=CPAttnMeta.from_plan(plan, doc_lens, 0), num_label_tokens=int((labels != -100).sum()),
                  file_index=0, row=0)
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab_size=256, dim=dim, num_layers=2, num_heads=4, num_kv_heads=2,
                                   ffn_dim=2 * dim)).to(device, torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = [train_step(model, optimizer, batch.to(device, non_blocking=True, comm="auto")).loss]
    if device.type != "cuda":
        losses.append(train_step(model, optimizer, batch.to(device)).loss)
        return 0, f"losses {losses[0]:.4f}, {losses[1]:.4f} (no CUDA: syncs not counted)"
    moved = batch.to(device, non_blocking=True, comm="auto")
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            losses.append(train_step(model, optimizer, moved).loss)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    return len(syncs), f"losses {losses[0]:.4f}, {losses[1]:.4f}; {len(syncs)} host syncs: {syncs}"


def does_it_work(device, small: bool) -> bool:
    """Section 1: imports, auto's choice, the ring through each backend, LSE shapes, one train step."""
    import warnings

    versions(device)
    print("\ndoes it work")
    ok = True
    probe = torch.zeros(2, 8, 128, device=device, dtype=torch.bfloat16)
    for backend in GPU_BACKENDS:
        why = kernels.unavailable_reason(backend, probe)
        why_blockwise = kernels.unavailable_reason(backend, probe, blockwise=True)
        status = "available" if why is None else f"unavailable: {why}"
        if why is None and why_blockwise is not None:
            status += f" (not for the ring: {why_blockwise})"
        print(f"  {backend:<13} {status}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        choice = (kernels.resolve_backend("auto", probe), kernels.resolve_backend("auto", probe, blockwise=True),
                  kernels.resolve_backend("auto", probe.float()))
    print(f"  auto on {device} bf16 D=128: {choice[0]} (ring: {choice[1]}); float32: {choice[2]}")
    for w in caught:
        print(f"    auto said: {w.message}")
    if device.type == "cuda" and choice[0] == "reference":
        print("  FAIL: no GPU kernel runs bf16 on this device")
        ok = False
    for backend in blockwise_backends(probe):
        for name, check in (("ring forward+backward", lambda b=backend: check_ring(device, b, small)),
                            ("LSE, length-1 shards, GQA, D=64", lambda b=backend: check_lse_shapes(device, b, 64)),
                            ("LSE, length-1 shards, GQA, D=128", lambda b=backend: check_lse_shapes(device, b, 128))):
            try:
                problem = check()
            except Exception as e:  # report and go on: one broken backend must not hide the others
                problem = f"{type(e).__name__}: {e}"
            ok &= not problem
            print(f"  {backend:<13} {name:<34} {'ok' if not problem else 'FAIL ' + problem}")
    try:
        syncs, detail = train_step_syncs(device, small)
        passed = syncs <= 1
    except Exception as e:
        passed, detail = False, f"{type(e).__name__}: {e}"
    ok &= passed
    print(f"  train step (bf16, one rank, sync debug mode): {'ok' if passed else 'FAIL'} {detail}")
    return ok


def float64_reference(device, doc_lens, heads, kv_heads, head_dim, seed):
    """(q, k, v, [out, dq, dk, dv], grad) in float64: dense document-masked attention."""
    context_len = int(np.sum(doc_lens))
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v, grad = (torch.randn(context_len, h, head_dim, dtype=torch.float64, device=device, generator=gen)
                     for h in (heads, kv_heads, kv_heads, heads))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = dense_attention(*leaves, doc_lens)
    ref.backward(grad)
    return q, k, v, [ref.detach()] + [t.grad for t in leaves], grad


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
    reference = float64_reference(device, doc_lens, heads, kv_heads, head_dim, seed=0)
    grad = reference[4]
    print(f"\naccuracy: C={context_len} cp={cp} H={heads} H_kv={kv_heads} D={head_dim} bf16, "
          f"{doc_lens.size} documents, {plan.num_shards} shards (random plan, shortest "
          f"{plan.shard_len.min()}); max |error| vs float64")
    plain = errors_against(lambda q, k, v: dense_attention(q, k, v, doc_lens), reference, grad,
                           torch.bfloat16)
    print(f"  {'implementation':<28} {'out':>9} {'dq':>9} {'dk':>9} {'dv':>9}  verdict")
    print(f"  {'plain PyTorch bf16 (dense)':<28} " + " ".join(f"{e:>9.2e}" for e in plain) + "  baseline")
    ok = True
    backends = GPU_BACKENDS + (("reference",) if small else ())
    for backend in backends:
        probe = reference[0][:1].to(torch.bfloat16)
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
    backend = kernels.resolve_backend("auto", probe, blockwise=True)
    if backend == "reference" and not small:
        backend = None
    print(f"\ntiming: C={context_len} cp={cp} H={heads} H_kv={kv_heads} D={head_dim} bf16, one rank's "
          f"attention fwd+bwd after its exchange (comm auto; the ring rows: ring), backend {backend}, "
          f"{num_seqs} sequences per dataset")
    if backend is None:
        print("  skipped: no GPU attention backend is available (see the first section)")
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
        results = {"works": does_it_work(device, args.small)}
        print(f"  ({time.monotonic() - started:.0f} s)")
        results["accuracy"] = accuracy_check(device, args.small)
        timing(device, args.small, args.budget, args.seqs)
        ok = all(results.values())
        print(f"\n{'PASS' if ok else 'FAIL'} ({time.monotonic() - started:.0f} s)")
    finally:
        report.close()
    if args.out:
        write_json_output(args.out / "gpu_check.json", REPORT_JSON,
                          {"format": "flashcp-gpu-check", **results, "pass": ok,
                           "seconds": time.monotonic() - started})
    return 0 if ok else 1


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
