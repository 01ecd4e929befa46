"""Train a tiny decoder with CP on a planned dataset and report the K/V bytes each comm mode moves.

    torchrun --nproc-per-node 2 examples/cp_attention_demo.py DATA cp2-flashcp [--steps 2]

The plan's ``cp`` must equal the number of ranks. gloo on CPU, NCCL when CUDA is available. Every step runs
the same batch once per comm mode (allgather, a2a, full, ring) from the same weights, checks that loss and
gradients agree across modes, and prints per mode the bytes each rank received (forward K/V; backward dK/dV,
and for the ring also the K/V blocks that go round again; all layers) next to the full-KV all-gather
baseline. Token ids are folded into the demo
model's small vocabulary (``id % vocab``).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from flashcp.models.tiny import TinyConfig, TinyDecoder
from flashcp.runtime import CommStats, CPLoader, cp_attention
from flashcp.train.launch import torchrun_group
from flashcp.train.loss import causal_lm_loss_sum

MODES = ("allgather", "a2a", "full", "ring")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("data", help="dataset folder")
    parser.add_argument("plan", help="plan name, e.g. cp2-flashcp")
    parser.add_argument("--steps", type=int, default=2, help="batches to run")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--backend", default="auto", help="fa3, fa4, flash_attn, torch_varlen, reference or auto")
    parser.add_argument("--dtype", default=None, choices=("float32", "float64", "bfloat16"),
                        help="model dtype (default: bfloat16 on CUDA, float32 on CPU)")
    return parser.parse_args()


def run_mode(model, batch, mode, backend, group, stats):
    """Forward + backward of one batch with one comm mode; returns (global loss, flat gradient)."""
    model.zero_grad(set_to_none=True)
    ids = batch.input_ids % model.cfg.vocab_size
    labels = torch.where(batch.labels >= 0, batch.labels % model.cfg.vocab_size, batch.labels)

    def attn_fn(q, k, v):
        return cp_attention(q, k, v, batch.attn, group=group, comm=mode, backend=backend, stats=stats)

    logits = model(ids, batch.position_ids, attn_fn)
    loss = causal_lm_loss_sum(logits, labels) / batch.num_label_tokens
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_reduce(grads, group=group)  # the rank-local losses add up to the sequence's mean loss
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return total.item(), grads


def main():
    args = parse_args()
    with torchrun_group() as launch:
        demo(args, launch.device)


def demo(args, device):
    """Run ``args.steps`` batches through every comm mode on ``device`` and report them from rank 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    torch.manual_seed(0)  # same initial weights on every rank
    cfg = TinyConfig(vocab_size=args.vocab, dim=args.dim, num_layers=args.layers, num_heads=args.heads,
                     num_kv_heads=args.kv_heads, ffn_dim=2 * args.dim)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    model = TinyDecoder(cfg).to(device, dtype)
    loader = CPLoader(args.data, args.plan, rank, world, shuffle=False)
    token_bytes = 2 * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize

    for step, batch in zip(range(args.steps), loader):
        batch = batch.to(device)
        results = {}
        for mode in MODES:
            stats = CommStats()
            loss, grads = run_mode(model, batch, mode, args.backend, group, stats)
            moved = [stats.total("recv_bytes", "forward"), stats.total("recv_bytes", "backward")]
            per_rank = [None] * world
            dist.all_gather_object(per_rank, moved, group=group)
            results[mode] = (loss, grads, per_rank)
        if rank == 0:
            report(step, batch, loader, results, world, cfg, token_bytes)
        params = list(model.parameters())
        with torch.no_grad():  # one plain SGD step so the next batch starts from new weights
            for p, g in zip(params, results["full"][1].split([p.numel() for p in params])):
                p -= 0.1 * g.view_as(p)


def report(step, batch, loader, results, world, cfg, token_bytes):
    """Per mode: loss, gradient difference to ``full``, bytes received per rank, and both against ``full``."""
    meta = batch.attn
    base_grads, full = results["full"][1], results["full"][2]
    print(f"step {step}: sequence {batch.row} of data file {batch.file_index}, {loader.context_len} tokens, "
          f"{world} ranks, {cfg.num_layers} layers, K/V {token_bytes} B/token/layer; "
          f"auto = {meta.auto_comm}")
    print(f"  {'mode':<10} {'loss':>8} {'max|dgrad|':>10} {'K/V in, fwd (B per rank)':>{11 * world}} "
          f"{'in, bwd (B per rank)':>{11 * world}} {'total B':>10} {'total/full':>10} "
          f"{'busiest/full':>12}")
    full_total, full_max = sum(sum(r) for r in full), max(sum(r) for r in full)
    for mode, (loss, grads, per_rank) in results.items():
        fwd = "".join(f"{r[0]:>11}" for r in per_rank)
        bwd = "".join(f"{r[1]:>11}" for r in per_rank)
        total, busiest = sum(sum(r) for r in per_rank), max(sum(r) for r in per_rank)
        print(f"  {mode:<10} {loss:>8.5f} {(grads - base_grads).abs().max().item():>10.1e} {fwd} {bwd} "
              f"{total:>10} {total / max(full_total, 1):>10.3f} {busiest / max(full_max, 1):>12.3f}")


if __name__ == "__main__":
    main()
