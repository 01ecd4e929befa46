"""How far a strategy's exact-need receive is from what CP-SAT finds: the room left at cp 16-32.

For every (distribution, cp), the first ``--seqs`` packed sequences of the bench (``flashcp bench``'s
sequences: seed 0, C = ``--context-len``) are planned with ``--strategy``; each plan warm-starts
``flashcp.planner.ilp.receive.minimise_receive`` (blocks of ``--granularity`` tokens plus the plan's own cuts,
every rank within ``--quota-slack`` tokens of its quota (512 as in issue 13; 0: exact quotas), every rank's
workload capped at the plan's own largest, ``--time-limit`` seconds). Printed per
row: mean largest receive of the strategy and of CP-SAT (share of ``(N-1) C / N``), the gap in percentage
points, CP-SAT's mean proven bound, and both mean projected step times (``flashcp.costmodel.objective``,
default profile). ``--json`` keeps every sequence.

    python scripts/cpsat_room.py --dists prolong,pile --cp 16,32 --seqs 8 --time-limit 60 --json room.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from flashcp.bench.quality import parse_strategy  # noqa: E402
from flashcp.bench.sequences import open_source  # noqa: E402
from flashcp.costmodel.objective import cached_model, plan_step_seconds  # noqa: E402
from flashcp.outputs import check_script_output, json_report, write_json_output  # noqa: E402
from flashcp.planner.ilp.receive import minimise_receive  # noqa: E402
from flashcp.planner.planning import plan_sequence  # noqa: E402
from flashcp.planner.registry import get_strategy  # noqa: E402

REPORT = json_report("flashcp-cpsat-room", "a scripts/cpsat_room.py report",
                     legacy=lambda value: set(value) == {"args", "rows", "time"})
"""``--json`` replaces only such a report (flashcp.outputs: never a dataset's file or a user's)."""


def main(argv=None) -> None:
    """Run the comparison and print one line per (distribution, cp)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dists", default="prolong,pile")
    parser.add_argument("--cp", default="16,32")
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--context-len", type=int, default=131072)
    parser.add_argument("--strategy", default="flashcp2", help="NAME[@TARGET][:KEY=VALUE;...]")
    parser.add_argument("--time-limit", type=float, default=60.0, help="CP-SAT seconds per sequence")
    parser.add_argument("--granularity", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=2, help="CP-SAT workers")
    parser.add_argument("--quota-slack", type=int, default=512, help="tokens a rank may be off its quota")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.json:
        check_script_output(args.json, REPORT)  # before the solves, not after them
    spec, name, params = parse_strategy(args.strategy)
    strategy = get_strategy(name)
    model = cached_model(None, 32, 32, 128, 1)
    rows = []
    for dist in args.dists.split(","):
        sequences = open_source(dist).sequences(args.seqs, args.context_len, 0)
        for cp in (int(c) for c in args.cp.split(",")):
            full = (cp - 1) * args.context_len / cp
            per_seq = []
            for i, lens in enumerate(sequences):
                plan = plan_sequence(strategy, lens, cp, **params)
                got = minimise_receive(lens, plan, granularity=args.granularity, time_limit_s=args.time_limit,
                                       quota_slack=args.quota_slack, num_workers=args.workers)
                per_seq.append({
                    "seq": i, "received_pct": 100 * plan.metrics().a2a_comm_tokens / full,
                    "imbalance": plan.metrics().imbalance, "step_ms": 1e3 * plan_step_seconds(plan, model),
                    "cpsat_received_pct": 100 * got.metrics.a2a_comm_tokens / full,
                    "cpsat_bound_pct": 100 * got.bound / full, "cpsat_imbalance": got.metrics.imbalance,
                    "cpsat_step_ms": 1e3 * plan_step_seconds(got.plan, model), "cpsat_status": got.status,
                    "cpsat_wall_s": got.wall_s, "num_blocks": got.num_blocks})
                print(f"{dist} cp{cp} seq {i}: {per_seq[-1]['received_pct']:.1f}% -> CP-SAT "
                      f"{per_seq[-1]['cpsat_received_pct']:.1f}% (bound {per_seq[-1]['cpsat_bound_pct']:.1f}%, "
                      f"{got.status}, {got.wall_s:.0f} s)", file=sys.stderr, flush=True)

            def mean(key, items=per_seq):
                return float(np.mean([s[key] for s in items]))

            row = {"dist": dist, "cp": cp, "strategy": spec, "seqs": len(per_seq),
                   "received_pct": mean("received_pct"), "cpsat_received_pct": mean("cpsat_received_pct"),
                   "gap_pp": mean("received_pct") - mean("cpsat_received_pct"),
                   "cpsat_bound_pct": mean("cpsat_bound_pct"), "step_ms": mean("step_ms"),
                   "cpsat_step_ms": mean("cpsat_step_ms"), "imbalance_max": max(s["imbalance"] for s in per_seq),
                   "sequences": per_seq}
            rows.append(row)
            print(f"{dist} cp{cp} {spec}: receive {row['received_pct']:.1f}%, CP-SAT {row['cpsat_received_pct']:.1f}% "
                  f"(gap {row['gap_pp']:.1f} pp; bound {row['cpsat_bound_pct']:.1f}%), step {row['step_ms']:.3f} ms "
                  f"vs CP-SAT's {row['cpsat_step_ms']:.3f} ms, max imbalance {row['imbalance_max']:.4f}", flush=True)
    if args.json:
        write_json_output(args.json, REPORT, {"format": "flashcp-cpsat-room", "args": vars(args), "rows": rows,
                                              "time": time.time()})


if __name__ == "__main__":
    main()
