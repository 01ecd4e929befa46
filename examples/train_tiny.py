"""Train a small decoder with flashcp context parallelism (and data parallelism) on a planned dataset.

    torchrun --nproc-per-node 2 examples/train_tiny.py DATA --plan cp2-flashcp --steps 20 --ckpt c.pt
    torchrun --nproc-per-node 2 examples/train_tiny.py DATA --plan cp2-flashcp --steps 40 --ckpt c.pt --resume
    torchrun --nproc-per-node 4 examples/train_tiny.py DATA --plan cp2-flashcp --dp 2 --sharding fsdp --ckpt ck
    torchrun --nproc-per-node 4 examples/train_tiny.py DATA --plan cp2-flashcp2 --dp 2 --model titan-qwen3
    torchrun --nproc-per-node 2 examples/train_tiny.py DATA --plan cp2-flashcp --steps 100 --lr-schedule cosine \
        --warmup-steps 10 --min-lr-ratio 0.1

The plan's ``cp`` times ``--dp`` must equal the number of ranks: the ranks form a ``(dp, cp)`` DeviceMesh,
consecutive ranks one CP group (``flashcp.train.parallel``). gloo on CPU, NCCL when CUDA is available;
without torchrun it runs as one process (a cp-1 plan). With ``--sharding fsdp`` (FSDP2) ``--ckpt`` is a
``torch.distributed.checkpoint`` folder. Logs loss, tokens/s and the K/V bytes moved per step, with a progress
bar on an interactive terminal. Token ids are folded into the model's vocabulary (``id % --vocab``). Bad
input (a bad option value, a plan for another number of ranks, a missing checkpoint, a ``--ckpt`` path
that is not a flashcp checkpoint) stops every rank before training; rank 0 prints one sentence and the
script exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys

from flashcp.cli.console import error, info, progress
from flashcp.errors import FlashcpError
from flashcp.integrations.models import MODELS, build_model
from flashcp.train.launch import torchrun_group
from flashcp.train.loop import DTYPES, LRSchedule, TrainOptions, run_training
from flashcp.train.schedule import LR_SCHEDULES


def parse_args(argv=None) -> TrainOptions:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("data", help="dataset folder")
    parser.add_argument("--plan", required=True, help="plan name, e.g. cp2-flashcp")
    parser.add_argument("--comm", default="auto", choices=("auto", "allgather", "a2a", "full"))
    parser.add_argument("--backend", default="auto", help="fa3, fa4, flash_attn, torch_varlen, reference or auto")
    parser.add_argument("--steps", type=int, default=10, help="total optimizer steps (one sequence each)")
    parser.add_argument("--lr", type=float, default=1e-3, help="base (peak) learning rate")
    parser.add_argument("--lr-schedule", default="constant", choices=LR_SCHEDULES,
                        help="after the warm-up: constant, or cosine / linear decay to --min-lr-ratio x --lr")
    parser.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up from 0 (0: none)")
    parser.add_argument("--min-lr-ratio", type=float, default=0.0, help="the decay's floor, a fraction of --lr")
    parser.add_argument("--decay-steps", type=int, default=None,
                        help="the step the decay reaches its floor at (default: --steps)")
    parser.add_argument("--dtype", default=None, choices=tuple(DTYPES),
                        help="parameter dtype (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--model", default="tiny", choices=MODELS,
                        help="tiny (flashcp.models.tiny), a transformers architecture or a torchtitan decoder")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ckpt", help="checkpoint file (written at the end and every --save-every steps)")
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--resume", action="store_true", help="continue from --ckpt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas (ranks = dp x the plan's cp)")
    parser.add_argument("--sharding", default="replicate", choices=("replicate", "fsdp"),
                        help="replicated weights with an all-reduce, or FSDP2 over the dp x cp mesh")
    parser.add_argument("--prefetch", type=int, default=2, help="batches built ahead on a thread (0: off)")
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step on each replica")
    parser.add_argument("--clip", type=float, default=0.0, help="clip gradients to this L2 norm (0: off)")
    parser.add_argument("--balance-window", type=int, default=16,
                        help="with --dp > 1: steps per window whose sequences are grouped by cost (0: off)")
    args = parser.parse_args(argv)
    schedule = LRSchedule(kind=args.lr_schedule, warmup_steps=args.warmup_steps, min_lr_ratio=args.min_lr_ratio,
                          decay_steps=args.decay_steps)
    return TrainOptions(data=args.data, plan=args.plan, steps=args.steps, comm=args.comm, backend=args.backend,
                        lr=args.lr, lr_schedule=schedule, dtype=args.dtype, model=args.model, vocab_size=args.vocab,
                        dim=args.dim, num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                        ckpt=args.ckpt, resume=args.resume, save_every=args.save_every, seed=args.seed,
                        dp=args.dp, sharding=args.sharding, prefetch=args.prefetch,
                        balance_window=args.balance_window, accum_steps=args.accum, max_grad_norm=args.clip)


def main(argv=None) -> int:
    try:
        options = parse_args(argv)
    except ValueError as e:  # a bad value (--vocab 0): one sentence from one rank, exit 1
        if int(os.environ.get("RANK", 0)) == 0:
            error(str(e))
        return 1
    with torchrun_group() as launch:
        try:
            run_training(options, group=None, device=launch.device, log=info, progress=progress,
                         build_model=build_model)
            status = 0
        except FlashcpError as e:  # raised alike on every rank: say it once
            if launch.rank == 0:
                error(str(e))
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
