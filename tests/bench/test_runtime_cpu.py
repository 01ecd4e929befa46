"""The runtime-on-CPU scenario (flashcp.bench.runtime_cpu): its cases and the ring ratios of one run."""


import json
from pathlib import Path

import pytest

from tests.bench import bench_run as _bench

ROOT = Path(__file__).resolve().parents[2]


def test_runtime_cases_ring_ratios(tmp_path):
    out = tmp_path / "rt.json"
    result = _bench("--scenario", "runtime", "--dist", "wlb", "--runtime-cases", "llama3/full,ring/full,ring/ring",
                    "--runtime-context-len", "128", "--runtime-cp", "2", "--runtime-seqs", "1", "--runtime-reps", "1",
                    "--runtime-heads", "2", "--runtime-kv-heads", "1", "--runtime-head-dim", "8", "--json", str(out))
    runtime = json.loads(out.read_text())["runtime"]
    assert [r["case"] for r in runtime["rows"]] == ["llama3/full", "ring/full", "ring/ring"]
    assert (runtime["num_heads"], runtime["num_kv_heads"], runtime["head_dim"]) == (2, 1, 8)
    by = {r["case"]: r["step_ms"] for r in runtime["rows"]}
    assert runtime["ring"]["ring_over_full"] == {"ring": pytest.approx(by["ring/ring"] / by["ring/full"])}
    assert runtime["ring"]["system_over"]["Ring-Attn"] == {"Llama3 CP": pytest.approx(by["ring/ring"] /
                                                                                      by["llama3/full"])}
    assert "step time, ring / full comm on the same layout: ring" in result.output
