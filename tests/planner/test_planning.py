"""The one planning path (``planning.plan_flat``): every caller gets the kernel's plan, then, for
``effort="ilp[:S]"``, the CP-SAT polish's."""

import numpy as np
import pytest

import flashcp.planner.ilp.polish as polish_module
from flashcp.bench.quality import _sequence_ms
from flashcp.planner.params import resolve_params
from flashcp.planner.pipeline import FileJob, warm_up
from flashcp.planner.planning import plan_rows, plan_sequence
from flashcp.planner.registry import get_strategy

LENS = np.array([5000, 300, 1200, 700, 985, 1800], np.int64)
SHARDS = ("shard_doc", "shard_start", "shard_len", "shard_rank")


def same(a, b) -> bool:
    return all(np.array_equal(getattr(a, name), getattr(b, name)) for name in SHARDS)


@pytest.fixture
def polish_calls(monkeypatch):
    """The polish replaced by one that records its call and returns the ``llama3`` plan of the sequence.

    A valid plan the kernel never makes: a caller that returns it took the polish's plan.
    """
    calls = []

    def polish(doc_lens, plan, model, seconds, seed=0):
        calls.append((np.asarray(doc_lens).tolist(), plan.cp, seconds, model.dtype.kind))
        return plan_sequence("llama3", doc_lens, plan.cp)

    monkeypatch.setattr(polish_module, "polish_plan", polish)
    return calls


def test_plan_sequence_polishes_with_effort_ilp(polish_calls):
    polished = plan_sequence("flashcp2", LENS, 4, effort="ilp:1")
    assert polish_calls == [(LENS.tolist(), 4, 1.0, "f")]  # the objective model, one second
    llama3 = plan_sequence("llama3", LENS, 4)
    assert same(polished, llama3)
    assert not same(plan_sequence("flashcp2", LENS, 4, effort=1), llama3)  # the kernel's own plan differs
    assert len(polish_calls) == 1  # a plain effort does not polish
    assert same(plan_sequence(get_strategy("flashcp2"), LENS, 4, effort="ilp:1"), llama3)  # by entry, alike


def test_plan_rows_and_the_bench_polish_every_row(polish_calls):
    lens = np.concatenate([LENS, LENS[::-1]])
    offsets = np.array([0, LENS.size, lens.size], np.int64)
    params = resolve_params(get_strategy("flashcp2"), effort="ilp:2")
    planned = plan_rows(offsets, lens, 4, "flashcp2", params)  # validated: the polish's plans are checked too
    assert [call[2] for call in polish_calls] == [2.0, 2.0]
    assert same(planned.row(1, 4), plan_sequence("llama3", LENS[::-1], 4))
    timed = _sequence_ms(offsets, lens, 4, "flashcp2", params)  # the bench times the same path, row by row
    assert len(polish_calls) == 4 and timed["plan_ms_max"] >= timed["plan_ms_p50"] >= 0


def test_warm_up_loads_the_kernel_without_polishing(polish_calls):
    params = resolve_params(get_strategy("flashcp2"), effort="ilp:1")
    warm_up(FileJob(root="unused", file_index=0, first_row=0, cp=2, strategy="flashcp2", params=params,
                    context_len=4096, compare_step=0, staging="unused"))
    assert polish_calls == []
