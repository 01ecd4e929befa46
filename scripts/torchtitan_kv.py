"""K/V bytes per training step: torchtitan's own context parallelism against flashcp's exchange, same sequences.

    python scripts/torchtitan_kv.py [--dist wlb] [--context-len 131072] [--num-seqs 8] [--cp 2,4] [--json FILE]

Counted from plans and per-rank attention metas, not timed. For every sequence (packed from the ``--dist``
document lengths the way ``flashcp synth`` packs them) and CP size:

- torchtitan 0.3 (``distributed/context_parallel``): the HeadTail layout (flashcp's ``llama3`` plan: 2N
  equal chunks, rank i holds chunks i and 2N-1-i) and ``flex_cp_allgather``: every layer all-gathers every
  rank's whole K/V, and the backward reduce-scatters dK/dV in the K/V dtype (bf16). That is the ``full``
  exchange of the ``llama3`` plan's meta, both passes at ``comm.kv_bytes_per_token``.
- flashcp: the default strategy's plan with ``a2a`` (exact need, both passes in the K/V dtype),
  ``allgather`` (compacted all-gather; its reduce-scatter sums in float32, ``comm.grad_bytes_per_token``)
  and ``auto`` (the meta's own choice).

Per rank and layer a pass moves the exchange's ``wire_send_tokens`` out and ``wire_recv_tokens`` in; the
backward is the reverse collective (the same tokens the other way). A step is one packed sequence per CP
group through all layers of the model shape (Llama3-8B attention by default: 32 layers, 8 KV heads, head dim
128, bf16). The table gives, averaged over the sequences, the busiest rank's bytes (sent plus received,
forward plus backward) and the bytes all ranks send, per step, and the ratio to torchtitan's.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from flashcp.bench.sequences import open_source
from flashcp.costmodel import comm
from flashcp.outputs import check_script_output, json_report, write_json_output
from flashcp.planner.planning import plan_sequence
from flashcp.planner.registry import DEFAULT_STRATEGY
from flashcp.runtime.meta import build_rank_metas

MIB = 1 << 20
REPORT = json_report("flashcp-torchtitan-kv", "a scripts/torchtitan_kv.py report",
                     legacy=lambda value: set(value) == {"args", "results"})
"""``--json`` replaces only such a report (flashcp.outputs: never a dataset's file or a user's)."""


def step_bytes(metas, comm: str, num_layers: int, kv_row: int, grad_row: int) -> tuple[int, int]:
    """``(busiest rank's sent + received, sent by all ranks)`` bytes of one step with the ``comm`` exchange."""
    sent, received = [], []
    for meta in metas:
        ex = meta.exchange(comm)
        out, into = (ex.wire_send_tokens, ex.wire_recv_tokens) if ex.active else (0, 0)
        sent.append(out * kv_row + into * grad_row)  # forward K/V out, backward dK/dV of borrowed rows out
        received.append(into * kv_row + out * grad_row)
    busiest = max(s + r for s, r in zip(sent, received))
    return num_layers * busiest, num_layers * sum(sent)


def measure(doc_lens_list, cp: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> dict:
    kv_row = comm.kv_bytes_per_token(num_kv_heads, head_dim, dtype_bytes)
    float_row = comm.grad_bytes_per_token(num_kv_heads, head_dim, dtype_bytes)
    rows: dict[str, list[tuple[int, int]]] = {"torchtitan": [], "a2a": [], "allgather": [], "auto": []}
    auto_modes = []
    for doc_lens in doc_lens_list:
        titan = build_rank_metas(plan_sequence("llama3", doc_lens, cp), doc_lens)
        rows["torchtitan"].append(step_bytes(titan, "full", num_layers, kv_row, kv_row))
        ours = build_rank_metas(plan_sequence(DEFAULT_STRATEGY, doc_lens, cp), doc_lens)
        rows["a2a"].append(step_bytes(ours, "a2a", num_layers, kv_row, kv_row))
        rows["allgather"].append(step_bytes(ours, "allgather", num_layers, kv_row, float_row))
        mode = ours[0].resolve_comm("auto")
        auto_modes.append(mode)
        rows["auto"].append(step_bytes(ours, mode, num_layers, kv_row, kv_row if mode == "a2a" else float_row))
    out = {name: {"busiest_mib": float(np.mean([b for b, _ in v])) / MIB,
                  "sent_mib": float(np.mean([s for _, s in v])) / MIB} for name, v in rows.items()}
    out["auto"]["modes"] = {m: auto_modes.count(m) for m in sorted(set(auto_modes))}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dist", default="wlb", help="length distribution (wlb, prolong, pile, JSON) or DATA")
    parser.add_argument("--context-len", type=int, default=131072)
    parser.add_argument("--num-seqs", type=int, default=8)
    parser.add_argument("--cp", default="2,4")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype-bytes", type=int, default=2)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.json:
        check_script_output(args.json, REPORT)  # before the work, not after it
    sequences = open_source(args.dist).sequences(args.num_seqs, args.context_len, args.seed)
    docs = sum(len(s) for s in sequences)
    print(f"{args.num_seqs} '{args.dist}' sequences of {args.context_len:,} tokens ({docs} documents); "
          f"{args.layers} layers, {args.kv_heads} KV heads, head dim {args.head_dim}, {args.dtype_bytes}-byte K/V; "
          f"flashcp plan '{DEFAULT_STRATEGY}'; MiB per step, mean over sequences")
    results = {}
    for cp in (int(c) for c in args.cp.split(",")):
        res = measure(sequences, cp, args.layers, args.kv_heads, args.head_dim, args.dtype_bytes)
        results[cp] = res
        base = res["torchtitan"]
        for name in ("torchtitan", "a2a", "allgather", "auto"):
            r = res[name]
            label = "torchtitan CP (all-gather)" if name == "torchtitan" else f"flashcp {name}"
            if name == "auto":
                label += " (" + ", ".join(f"{m} x{n}" for m, n in r["modes"].items()) + ")"
            print(f"cp {cp}  {label:<34} busiest rank {r['busiest_mib']:>9,.1f}  "
                  f"({r['busiest_mib'] / base['busiest_mib']:.3f}x)  all ranks sent {r['sent_mib']:>9,.1f}  "
                  f"({r['sent_mib'] / base['sent_mib']:.3f}x)")
    if args.json:
        write_json_output(args.json, REPORT, {"format": "flashcp-torchtitan-kv", "args": vars(args),
                                              "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
