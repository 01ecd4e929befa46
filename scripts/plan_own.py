"""A strategy's own planning time on a dataset's first data file: its batch kernel over every row group, in one
process, the kernel loaded before the clock starts (what `flashcp plan`'s CPU time is compared with).

    python scripts/plan_own.py DATA CP [--strategy flashcp2]
"""

import argparse
import time

import numpy as np
import pyarrow.parquet as pq

from flashcp.planner import batch
from flashcp.planner.params import kernel_args, resolve_params
from flashcp.planner.registry import get_strategy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data")
    parser.add_argument("cp", type=int)
    parser.add_argument("--strategy", default="flashcp2")
    args = parser.parse_args()
    strategy = get_strategy(args.strategy)
    kernel = kernel_args(strategy, resolve_params(strategy))
    data_file = pq.ParquetFile(f"{args.data}/data/part-00000.parquet")
    groups = []
    for g in range(data_file.num_row_groups):
        column = data_file.read_row_group(g, columns=["doc_lens"]).column("doc_lens").combine_chunks()
        offsets = np.asarray(column.offsets, np.int64)
        groups.append((offsets - offsets[0], np.asarray(column.values, np.int64)))
    batch.plan_batch(groups[0][0][:2], groups[0][1], args.cp, strategy, **kernel)  # load, not timed
    began = time.process_time()
    for offsets, lens in groups:
        batch.plan_batch(offsets, lens, args.cp, strategy, **kernel)
    own = time.process_time() - began
    rows = sum(offsets.size - 1 for offsets, _ in groups)
    print(f"{strategy.name}: {own:.2f} s CPU for {rows} rows ({1000 * own / rows:.3f} s per 1,000)")


if __name__ == "__main__":
    main()
