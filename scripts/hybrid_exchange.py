"""Bytes per training step of hybrid models under CP against their all-attention twins, and split pieces' extra work.

For each distribution and CP size, packs ``--num-seqs`` sequences of ``--context-len`` tokens (``flashcp synth``'s
packing, ``--seed``), plans each with ``flashcp2`` twice: as ``flashcp plan`` does by default (made for
``DEFAULT_MODEL``, which prices attention alone: rows ``default``) and made for the hybrid itself (its
attention layers and its recurrent layers priced, ``HybridModel.attention_shape``: rows ``hybrid``), and
prices every plan for Qwen3-Next-80B-A3B and Nemotron-H-8B (``flashcp.costmodel.hybrid``): the projected step
time under the hybrid's price (``objective.plan_step_seconds``, the default profile), the bytes one step (every layer,
forward and backward) exchanges for the hybrid (attention layers' exact-need K/V in bf16, recurrent layers'
float32 state maps and conv inputs, point to point) and for the same model with every mixing layer full
attention, the busiest rank's and all ranks' bytes, mean and max over the sequences; what the recurrent layers
of the same plans moved with the runtime's earlier all-gather (every contributed map and conv tail to every
rank, padded to the busiest rank's count: ``_allgather_bytes``, for comparison only); and the recurrent layers'
extra work of split pieces as a share of their work (``flashcp.costmodel.recurrent.split_work``): all ranks
together, and the largest share of one rank.

    python scripts/hybrid_exchange.py --dists wlb,prolong --cp 8,16 --num-seqs 50
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flashcp import __version__  # noqa: E402
from flashcp.costmodel.hybrid import NEMOTRON_H_8B, QWEN3_NEXT_80B_A3B, step_bytes  # noqa: E402
from flashcp.costmodel.models import DEFAULT_MODEL, as_model_spec  # noqa: E402
from flashcp.costmodel.objective import cached_shape_model, plan_step_seconds  # noqa: E402
from flashcp.costmodel.recurrent import recurrent_contributes, split_work  # noqa: E402
from flashcp.data.synth import load_distribution, pack_lengths  # noqa: E402
from flashcp.errors import FlashcpError  # noqa: E402
from flashcp.planner.params import resolve_params  # noqa: E402
from flashcp.planner.plan import SequencePlan  # noqa: E402
from flashcp.planner.planning import plan_flat, plan_sequence  # noqa: E402
from flashcp.planner.registry import get_strategy  # noqa: E402

MODELS = (QWEN3_NEXT_80B_A3B, NEMOTRON_H_8B)
GB = 1e9


def _plan_for_hybrid(lens: np.ndarray, cp: int, model) -> SequencePlan:
    strategy = get_strategy("flashcp2")
    _, doc, start, length, rank = plan_flat(strategy, np.array([0, lens.size], np.int64), lens, cp,
                                            resolve_params(strategy), shape=model.attention_shape())
    return SequencePlan(shard_doc=doc, shard_start=start, shard_len=length, shard_rank=rank, cp=cp)


def measure(dist: str, cp: int, num_seqs: int, context_len: int, seed: int) -> dict:
    """(model name, plan made for) -> list of per-sequence rows (step time, bytes and extra-work shares)."""
    rng = np.random.default_rng(seed)
    offsets, doc_lens, *_ = pack_lengths(load_distribution(dist), rng, num_seqs, context_len)
    rows: dict = {(model.name, made): [] for model in MODELS for made in ("default", "hybrid")}
    planned_for = as_model_spec(DEFAULT_MODEL)  # as `flashcp plan` without --model
    for i in range(num_seqs):
        lens = doc_lens[offsets[i]:offsets[i + 1]]
        default = plan_sequence("flashcp2", lens, cp, model=planned_for)
        for model in MODELS:
            for made, plan in (("default", default), ("hybrid", _plan_for_hybrid(lens, cp, model))):
                _row(rows[model.name, made], model, plan, cp)
    return rows


def _allgather_bytes(model, plan: SequencePlan) -> int:
    """All ranks' recurrent bytes per step under the exchange the runtime used before point-to-point routes.

    Per layer and pass one all-gather of the maps and one of the conv tails (``W - 1`` tokens each), every
    rank putting in ``slot`` rows (the most pieces any rank contributes; zero rows pad the others) and sending
    them to the ``cp - 1`` others; the backward's reduce-scatters moved as many bytes.
    """
    arrays = (plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, plan.cp)
    contributes = recurrent_contributes(*arrays)
    slot = int(np.bincount(plan.shard_rank[contributes], minlength=plan.cp).max()) if contributes.any() else 0
    rec = model.recurrent
    row = rec.map_bytes + (rec.conv_width - 1) * rec.conv_token_bytes
    return 2 * rec.num_layers * plan.cp * (plan.cp - 1) * slot * row


def _row(rows: list, model, plan: SequencePlan, cp: int) -> None:
    """Append one plan's step time under ``model``'s price, its bytes and its extra-work shares to ``rows``."""
    arrays = (plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, cp)
    work = split_work(*arrays)
    step = step_bytes(model, *arrays)
    extra = work.extra_tokens(model.recurrent)
    rows.append({
        "step_ms": 1e3 * plan_step_seconds(plan, cached_shape_model(None, model.attention_shape())),
        "hybrid_busiest": step.hybrid_busiest, "hybrid_total": step.hybrid_total,
        "attention_busiest": step.attention_busiest, "attention_total": step.attention_total,
        "recurrent_total": step.recurrent_total, "recurrent_allgather": _allgather_bytes(model, plan),
        "extra_share": float(extra.sum() / work.tokens.sum()),
        "extra_rank_share": float(np.max(extra / np.maximum(work.tokens, 1))),
        "cut": int(np.count_nonzero(np.bincount(plan.shard_doc) > 1)),
    })


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dists", default="wlb,prolong")
    parser.add_argument("--cp", default="8,16")
    parser.add_argument("--num-seqs", type=int, default=20)
    parser.add_argument("--context-len", type=int, default=131072)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not all(c.strip().isdigit() for c in args.cp.split(",")):
        print(f"hybrid_exchange: --cp must be whole numbers separated by commas, got {args.cp!r}", file=sys.stderr)
        return 1
    cps = [int(c) for c in args.cp.split(",")]
    try:
        dists = [load_distribution(d).name for d in args.dists.split(",")]
    except (ValueError, FlashcpError) as e:
        print(f"hybrid_exchange: {e}", file=sys.stderr)
        return 1
    if args.num_seqs < 1 or args.context_len < max(cps) or min(cps) < 2:
        print(f"hybrid_exchange: need --num-seqs >= 1, every --cp >= 2 and --context-len >= the largest cp; got "
              f"{args.num_seqs}, {args.cp} and {args.context_len}", file=sys.stderr)
        return 1
    started = time.perf_counter()
    print(f"flashcp {__version__}, numpy {np.__version__}, Python {platform.python_version()}, "
          f"{args.num_seqs} sequences of {args.context_len} tokens, seed {args.seed}, flashcp2 plans")
    print(f"plans made for: default = {DEFAULT_MODEL} (the default of flashcp plan), hybrid = the hybrid model; "
          "projected step ms under the hybrid's price (default profile); GB per step (forward + backward, all "
          "layers): busiest rank max(sent, received), all ranks' sent; mean / max over sequences; ratios of sums")
    print("| dist | cp | model | plan made for | projected step ms | cut docs | hybrid busiest | all-attn busiest | "
          "hybrid total | all-attn total | "
          "hybrid / all-attn (total) | recurrent share of hybrid total | recurrent total | recurrent total with "
          "the all-gather | all-gather / now | extra recurrent work: all ranks | busiest rank |")
    print("| --- " * 17 + "|")
    # ratios of sums over the sequences: a sequence whose attention moves almost nothing would swamp a mean
    for dist in dists:
        for cp in cps:
            for (name, made), rows in measure(dist, cp, args.num_seqs, args.context_len, args.seed).items():
                col = {key: np.array([r[key] for r in rows], dtype=np.float64) for key in rows[0]}

                def gb(key, col=col):
                    return f"{col[key].mean() / GB:.2f} / {col[key].max() / GB:.2f}"

                def pct(key, col=col):
                    return f"{100 * col[key].mean():.2f}% / {100 * col[key].max():.2f}%"

                ratio = col["hybrid_total"].sum() / max(col["attention_total"].sum(), 1.0)
                rec_share = col["recurrent_total"].sum() / max(col["hybrid_total"].sum(), 1.0)
                shrink = col["recurrent_allgather"].sum() / max(col["recurrent_total"].sum(), 1.0)
                print(f"| {dist} | {cp} | {name} | {made} | {col['step_ms'].mean():.1f} / {col['step_ms'].max():.1f} | "
                      f"{col['cut'].mean():.1f} / {col['cut'].max():.0f} | "
                      f"{gb('hybrid_busiest')} | "
                      f"{gb('attention_busiest')} | {gb('hybrid_total')} | {gb('attention_total')} | "
                      f"{ratio:.2f} | {100 * rec_share:.1f}% | {gb('recurrent_total')} | {gb('recurrent_allgather')} | "
                      f"{shrink:.1f}x | {pct('extra_share')} | "
                      f"{pct('extra_rank_share')} |")
    print(f"wall time {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
