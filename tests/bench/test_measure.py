"""The device-timing code paths of ``--measured`` and ``--calibrate``, run on the CPU at toy size.

They are meant for a GPU; here they run with the ``reference`` backend in float32 so that every line is
exercised in CI. No timing is asserted, only shapes, signs and that the results feed the projection.
"""

import numpy as np
import torch

from flashcp.bench.calibrate import calibrate_profile
from flashcp.bench.measure import measured_work
from flashcp.costmodel.profile import load_profile
from flashcp.costmodel.projection import project_step
from flashcp.costmodel.shape import AttentionShape
from tests.emulate import random_plan

SHAPE = AttentionShape(num_heads=2, num_kv_heads=1, head_dim=8, dtype_bytes=4)
CPU = torch.device("cpu")


def test_measured_work_feeds_the_projection():
    rng = np.random.default_rng(0)
    doc_lens = np.array([30, 5, 12, 17])
    plan = random_plan(doc_lens, 3, rng, max_pieces=3, cut_prob=0.1)
    profile = load_profile()
    for comm in ("full", "auto"):
        work = measured_work(plan, doc_lens, SHAPE, profile, comm, CPU, torch.float32, "reference", reps=1)
        assert work.measured and work.local_fwd.shape == (3,)
        assert (work.local_fwd + work.remote_fwd > 0).all() and (work.local_bwd + work.remote_bwd > 0).all()
        step = project_step(plan, SHAPE, profile, comm, overlap=True, work=work)
        assert step.measured and step.total >= step.attn_fwd + step.attn_bwd > 0


def test_calibrated_profile_replaces_measured_parts_only():
    base = load_profile()
    profile = calibrate_profile(base, CPU, dtype=torch.float32, shape=SHAPE, lengths=(4, 16, 64),
                                total_tokens=64, backend="reference", reps=1)
    assert profile.calibrated and profile.lengths == (4, 16, 64)
    assert min(profile.forward_tflops) > 0 and min(profile.backward_tflops) > 0 and profile.hbm_gbps > 0
    assert profile.link_gbps == base.link_gbps and "kept from" in profile.sources["link_gbps"]
    assert "measured by flashcp bench --calibrate on cpu" in profile.sources["attention_tflops"]


def test_measured_latency_scenario_labels_its_rows():
    from flashcp.bench.latency import latency_scenario
    from flashcp.bench.sequences import open_source
    from flashcp.bench.systems import PlanBook, default_systems

    systems, _ = default_systems()

    def measure(plan, doc_lens, shape, profile, comm):
        return measured_work(plan, doc_lens, shape, profile, comm, CPU, torch.float32, "reference", reps=1)

    result = latency_scenario(PlanBook(0), [open_source("pile")], systems, [2], [2], 512, 2, load_profile(),
                              head_dim=8, sweep_seqs=1, measure=measure, measure_seqs=1)
    (setting,) = result["settings"]
    assert result["measured"]
    for label, row in setting["systems"].items():
        assert row["num_seqs"] == 1
        assert row["kind"] == ("projected" if row["comm"] == "ring" else "measured"), label
