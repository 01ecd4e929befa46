"""``flashcp plan --engine ray``: one Ray task per data file, running the local planner's own per-file job.

``flashcp.planner.pipeline`` builds the jobs, stages and publishes the plan; only where the jobs run changes.
Every job reads its data file, plans and validates every row, and writes its plan file into the staging folder
(which must be on a filesystem every Ray node shares), so the plan's bytes are the local ones by construction.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from flashcp.engines.ray_cluster import get_result, require_ray
from flashcp.errors import FlashcpError

__all__ = ["run_jobs"]


def run_jobs(jobs: list, workers: int, progress: Callable[[int], None] | None) -> list:
    """Run ``pipeline.plan_data_file`` on every job as a Ray task; the results in job order.

    ``workers`` is not used: the cluster's CPUs set how many jobs run at once.
    """
    from flashcp.planner.pipeline import plan_data_file, warm_up

    ray = require_ray()
    if jobs:
        # compile (and cache) the kernels here once, so that the workers on this node load them instead of
        # each compiling them at the same time
        warm_up(jobs[0])
    plan_file = ray.remote(num_cpus=1)(plan_data_file)
    refs = [plan_file.remote(job) for job in jobs]
    results = []
    try:
        for job, ref in zip(jobs, refs):
            results.append(get_result(ray, ref))
            if not (Path(job.staging) / results[-1].plan_file["path"]).is_file():
                raise FlashcpError(f"a Ray worker wrote a plan file where the driver cannot see it; the dataset "
                                   f"folder {job.root} must be on a filesystem every Ray node shares")
            if progress:
                progress(int(results[-1].metrics[0].size))
    except BaseException:
        for ref in refs:
            ray.cancel(ref)
        ray.wait(refs, num_returns=len(refs), timeout=60)
        raise
    return results
