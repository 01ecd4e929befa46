"""bench/ring_cost.py at toy size: it runs and prints a row per system and dataset."""

import importlib.util
from pathlib import Path


def test_ring_cost_runs_small(capsys):
    path = Path(__file__).resolve().parents[1] / "bench" / "ring_cost.py"
    spec = importlib.util.spec_from_file_location("ring_cost", path)
    ring_cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ring_cost)
    assert ring_cost.main(["--context-len", "512", "--cp", "4", "--seqs", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for data in ("wlb", "pile"):
        for config in ("llama3+full", "perdoc+full", "ring+ring", "perdoc+ring"):
            rows = [line for line in lines if line.split()[:1] == [data] and f" {config} " in line]
            assert len(rows) == 1, f"{data} {config}: {rows}"
            # every rank receives 3/4 of the sequence's K/V with the ring and with the full all-gather
            assert rows[0].split()[-1] == "0.750"
