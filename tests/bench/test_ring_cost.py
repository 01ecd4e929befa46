"""The ring-cost scenario (flashcp.bench.ring_cost): the ring's and the full all-gather's K/V share."""


import json
from pathlib import Path

import pytest

from tests.bench import bench_run as _bench

ROOT = Path(__file__).resolve().parents[2]


def test_ring_cost_scenario(tmp_path):
    out = tmp_path / "r.json"
    result = _bench("--scenario", "ring-cost", "--dist", "wlb,pile", "--cp", "4", "--seqs", "2", "--context-len",
                    "512", "--json", str(out))
    assert "Ring baselines by the cost model" in result.output
    rows = json.loads(out.read_text())["ring-cost"]["rows"]
    for source in ("wlb", "pile~lognormal"):
        mine = {(r["layout"], r["comm"]): r for r in rows if r["source"] == source}
        assert {("llama3", "full"), ("perdoc", "full"), ("ring", "ring"), ("perdoc", "ring")} <= set(mine)
        for key in (("llama3", "full"), ("perdoc", "full"), ("ring", "ring"), ("perdoc", "ring")):
            # every rank receives 3/4 of the sequence's K/V with the ring and with the full all-gather
            assert mine[key]["recv_over_c"] == pytest.approx(0.75)
        assert mine[("perdoc", "ring")]["calls"] == 4.0  # one call per ring step, every step has work
