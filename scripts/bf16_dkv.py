"""bf16 accuracy of cp_attention's backward against plain single-process SDPA in bf16, every comm mode.

    python scripts/bf16_dkv.py [--cp 2,4] [--context-len 1024] [--seeds 3] [--json FILE]

For each CP size it spawns that many gloo ranks on CPU. Every rank draws the same sequences: a
single-document one and a many-document one (lengths from the shipped WLB-LLM list, cut to fit), plans them
with ``perdoc`` and ``flashcp+``, and runs one attention layer's forward and backward in bfloat16 with each
comm mode (``allgather``, ``a2a``, ``full``, ``ring``). The errors are taken against a float64 dense
reference (document-masked attention of the whole sequence): relative L2 error ``||x - ref|| / ||ref||`` of
out, dq, dk and dv over the whole sequence (every rank's slice gathered). The baseline is
``scaled_dot_product_attention`` in bfloat16 over the whole sequence with the document mask, in one
process; the table gives each error divided by the baseline's (1.0: as accurate as no CP), the mean over
``--seeds`` random q/k/v draws.

The script uses only flashcp's public runtime, so the same file measures any checkout:
``PYTHONPATH=<checkout> python scripts/bf16_dkv.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from flashcp.errors import FlashcpError
from flashcp.outputs import check_output, json_report, write_json_output
from flashcp.planner.planning import plan_sequence
from flashcp.runtime import CommStats, CPAttnMeta, cp_attention
from flashcp.runtime.meta import rank_token_positions
from flashcp.train.launch import free_port, init_local_gloo

COMMS = ("allgather", "a2a", "full", "ring")
STRATEGIES = ("perdoc", "flashcp+")
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
DIST = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "dist_wlbllm.json"


def sequences(context_len: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``single-doc`` and ``many-doc`` document lengths, each summing to ``context_len``."""
    lengths = None
    for candidate in (Path("/work/shared/data/dist_wlbllm.json"), DIST):
        if candidate.is_file():
            lengths = np.asarray(json.loads(candidate.read_text()), dtype=np.int64)
            break
    lens = []
    while sum(lens) < context_len:
        n = int(rng.choice(lengths)) if lengths is not None else int(rng.lognormal(5, 1)) + 1
        lens.append(max(1, min(n, context_len // 4, context_len - sum(lens))))
    return {"single-doc": np.array([context_len]), "many-doc": np.array(lens)}


def dense_reference(q, k, v, doc_lens):
    """Document-masked causal attention of the whole sequence, any dtype, via SDPA with a boolean mask."""
    context_len = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.as_tensor(doc_lens))
    pos = torch.arange(context_len)
    keep = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
                                         v.repeat_interleave(group, 1).transpose(0, 1), attn_mask=keep)
    return out.transpose(0, 1)


def errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative L2 error, max abs error) of ``got`` against the float64 ``ref``."""
    diff = got.detach().double() - ref
    return float(diff.norm() / ref.norm()), float(diff.abs().max())


def _worker(rank: int, cp: int, port: int, context_len: int, seeds: int, queue) -> None:
    init_local_gloo(rank, cp, port)
    rows = []
    for name, doc_lens in sequences(context_len, np.random.default_rng(cp)).items():
        plans = {s: plan_sequence(s, doc_lens, cp) for s in STRATEGIES}
        for seed in range(seeds):
            gen = torch.Generator().manual_seed(seed)
            q, k, v, dout = (torch.randn(context_len, h, HEAD_DIM, generator=gen, dtype=torch.float64)
                             for h in (HEADS, KV_HEADS, KV_HEADS, HEADS))
            ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
            ref_out = dense_reference(*ref_in, doc_lens)
            ref = (ref_out.detach(), *torch.autograd.grad(ref_out, ref_in, dout))
            base_in = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
            base_out = dense_reference(*base_in, doc_lens)
            base = (base_out, *torch.autograd.grad(base_out, base_in, dout.to(torch.bfloat16)))
            base_err = [errors(b, r) for b, r in zip(base, ref)]
            for strategy, plan in plans.items():
                meta = CPAttnMeta.from_plan(plan, doc_lens, rank)
                pos = torch.from_numpy(rank_token_positions(plan, doc_lens, rank)[0])
                for comm in COMMS:
                    inputs = [t[pos].to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
                    stats = CommStats()
                    out = cp_attention(*inputs, meta, comm=comm, backend="reference", stats=stats)
                    grads = torch.autograd.grad(out, inputs, dout[pos].to(torch.bfloat16))
                    got = [torch.zeros(context_len, *t.shape[1:], dtype=torch.float64) for t in ref]
                    for g, mine in zip(got, (out, *grads)):
                        g[pos] = mine.detach().double()
                        dist.all_reduce(g)  # every rank's slice, disjoint: the sum is the whole sequence
                    errs = [errors(g, r) for g, r in zip(got, ref)]
                    row = {"cp": cp, "sequence": name, "strategy": strategy, "comm": comm, "seed": seed,
                           "kv_sent_bytes": stats.total("sent_bytes", tensor="kv", direction="forward"),
                           "dkv_sent_bytes": stats.total("sent_bytes", tensor="dkv")}
                    for t, e, b in zip(("out", "dq", "dk", "dv"), errs, base_err):
                        row[f"{t}_ratio"], row[f"{t}_max_ratio"] = e[0] / b[0], e[1] / b[1]
                    rows.append(row)
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", default="2,4")
    parser.add_argument("--context-len", type=int, default=1024)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    report = json_report("flashcp-bf16-dkv", "a scripts/bf16_dkv.py report")
    if args.json:
        try:
            check_output(args.json, report)  # before the runs, not after them
        except FlashcpError as e:
            raise SystemExit(f"error: {e}") from None
    ctx = mp.get_context("spawn")
    rows = []
    for cp in (int(c) for c in args.cp.split(",")):
        queue = ctx.SimpleQueue()
        mp.start_processes(_worker, args=(cp, free_port(), args.context_len, args.seeds, queue), nprocs=cp,
                           join=True, start_method="spawn")
        rows += queue.get()
    print_ratios(rows, args)
    print_bytes(rows)
    print_loss_error()
    if args.json:
        write_json_output(args.json, report, {"format": "flashcp-bf16-dkv", "rows": rows})
    return 0


def print_ratios(rows, args) -> None:
    print(f"bf16 error / plain bf16 SDPA error, mean of {args.seeds} draws, C={args.context_len}, H={HEADS} "
          f"K={KV_HEADS} D={HEAD_DIM}; relative L2 error, then max abs error")
    print(f"{'cp':>2} {'sequence':<10} {'plan':<8} {'comm':<9} {'out':>5} {'dq':>5} {'dk':>5} {'dv':>5} | "
          f"{'out':>5} {'dq':>5} {'dk':>5} {'dv':>5}")
    keys = sorted({(r["cp"], r["sequence"], r["strategy"], r["comm"]) for r in rows},
                  key=lambda k: (k[0], k[1] != "single-doc", STRATEGIES.index(k[2]), COMMS.index(k[3])))
    for key in keys:
        mine = [r for r in rows if (r["cp"], r["sequence"], r["strategy"], r["comm"]) == key]
        means = [np.mean([r[f"{t}_ratio"] for r in mine]) for t in ("out", "dq", "dk", "dv")]
        maxes = [np.mean([r[f"{t}_max_ratio"] for r in mine]) for t in ("out", "dq", "dk", "dv")]
        print(f"{key[0]:>2} {key[1]:<10} {key[2]:<8} {key[3]:<9} " + " ".join(f"{m:5.2f}" for m in means)
              + " | " + " ".join(f"{m:5.2f}" for m in maxes))


def print_bytes(rows) -> None:
    """Forward K/V and backward dK/dV bytes rank 0 sent in one layer (perdoc, seed 0)."""
    print("\nbytes rank 0 sent in one attention layer (perdoc plan): forward K/V, backward dK/dV")
    print(f"{'cp':>2} {'sequence':<10} {'comm':<9} {'K/V':>9} {'dK/dV':>9} {'ratio':>6}")
    for r in rows:
        if r["strategy"] == "perdoc" and r["seed"] == 0:
            ratio = r["dkv_sent_bytes"] / r["kv_sent_bytes"] if r["kv_sent_bytes"] else float("nan")
            print(f"{r['cp']:>2} {r['sequence']:<10} {r['comm']:<9} {r['kv_sent_bytes']:>9} "
                  f"{r['dkv_sent_bytes']:>9} {ratio:6.2f}")


def print_loss_error(num_tokens: int = 4096, vocab: int = 32000) -> None:
    """Relative error of a summed next-token loss over bf16 logits: computed in bf16, and the way
    ``causal_lm_loss_sum`` computes it."""
    from flashcp.train.loss import causal_lm_loss_sum

    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(num_tokens, vocab, generator=gen)).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (num_tokens,), generator=gen)
    ref = F.cross_entropy(logits.double(), labels, reduction="sum").item()
    in_bf16 = F.cross_entropy(logits, labels, reduction="sum").item()
    flashcp = causal_lm_loss_sum(logits, labels).item()
    print(f"\nsummed loss over {num_tokens} tokens, vocabulary {vocab}, bf16 logits: relative error "
          f"{abs(in_bf16 - ref) / ref:.2e} computed in bf16, {abs(flashcp - ref) / ref:.2e} by causal_lm_loss_sum")


if __name__ == "__main__":
    sys.exit(main())
