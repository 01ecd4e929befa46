"""DP step balance (flashcp.runtime.balance and CPLoader's balance_window): optimal grouping against brute force,
every sequence once per epoch, the same multiset per window as the stream order, exact resume across dp changes."""

import itertools
import json

import numpy as np
import pytest

from flashcp.planner.plan_reader import PlanStore
from flashcp.runtime import CPLoader
from flashcp.runtime.balance import balanced_epoch, balanced_order, step_efficiency
from flashcp.runtime.loader import stream_rows
from tests.emulate import random_plan
from tests.plans import write_dataset, write_plan

CONTEXT = 32
CP = 2
ROWS = (13, 11, 7)
NUM = sum(ROWS)


def step_max_sum(costs, dp):
    """Sum over the whole steps of ``costs`` (stream order) of each step's largest cost."""
    full = len(costs) // dp
    return float(np.asarray(costs[:full * dp]).reshape(full, dp).max(axis=1).sum()) if full else 0.0


def all_step_max_sum(costs, dp):
    """Sum of each step's largest cost, a last partial step included."""
    return sum(max(costs[i:i + dp]) for i in range(0, len(costs), dp))


def brute_force_best(costs, dp):
    """The smallest sum of step maxima over every grouping of ``costs`` into steps of ``dp`` (a partial last)."""
    return min(all_step_max_sum([costs[i] for i in order], dp)
               for order in itertools.permutations(range(len(costs))))


def test_balanced_order_is_the_best_grouping():
    rng = np.random.default_rng(0)
    for _ in range(60):
        n, dp = int(rng.integers(1, 8)), int(rng.integers(1, 4))
        costs = rng.choice([1.0, 2.0, 3.0, 5.0], size=n) if rng.random() < 0.3 else rng.random(n)
        order = balanced_order(costs, dp, rng)
        assert sorted(order.tolist()) == list(range(n)), "a permutation of the window"
        got = all_step_max_sum(costs[order].tolist(), dp)
        assert got == pytest.approx(brute_force_best(costs.tolist(), dp), rel=1e-12), (costs, dp)
        if n % dp and n > dp:  # the partial step holds the cheapest sequences, last
            assert costs[order[-(n % dp):]].max() <= costs[order[:n - n % dp]].min()


def test_balanced_order_beats_the_stream_on_random_costs():
    rng = np.random.default_rng(1)
    for _ in range(200):
        dp, steps = int(rng.integers(1, 9)), int(rng.integers(1, 33))
        costs = rng.lognormal(0, 1, size=dp * steps + int(rng.integers(0, dp)))
        balanced = costs[balanced_order(costs, dp, rng)]
        assert all_step_max_sum(balanced.tolist(), dp) <= all_step_max_sum(costs.tolist(), dp) + 1e-9
        whole = steps * dp
        assert step_efficiency(balanced[:whole], dp) >= step_efficiency(costs[:whole], dp) - 1e-12 or \
            costs.size > whole
        assert balanced.max() == costs.max() and sorted(balanced) == sorted(costs)
    assert step_efficiency(np.array([1.0, 3.0, 2.0, 2.0]), 2) == pytest.approx(2.0 / 2.5)
    assert step_efficiency(np.array([1.0, 3.0]), 1) == 1.0


def random_doc_lens(rng, context_len):
    cuts = np.sort(rng.choice(np.arange(1, context_len), size=int(rng.integers(0, 6)), replace=False))
    return np.diff(np.r_[0, cuts, context_len])


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """A 3-file dataset (13 + 11 + 7 rows, row groups of 3) with a random cp-2 plan."""
    root = tmp_path_factory.mktemp("balance") / "data"
    rng = np.random.default_rng(3)
    files = [[random_doc_lens(rng, CONTEXT) for _ in range(n)] for n in ROWS]
    dataset, _ = write_dataset(root, files, CONTEXT, rng, row_group_rows=3)
    write_plan(dataset, "cp2-test", [[random_plan(lens, CP, rng) for lens in rows] for rows in files], CP)
    costs = np.concatenate([PlanStore(dataset, "cp2-test").seq_costs(i) for i in range(len(ROWS))])
    assert np.unique(costs).size > 5, "the sequences must differ in cost"
    return dataset, costs


def global_row(batch):
    return int(np.r_[0, np.cumsum(ROWS)][batch.file_index] + batch.row)


def run(loaders, num_steps, iters=None):
    """The global rows of the next ``num_steps`` steps of the replicas ``loaders`` (one per dp rank)."""
    iters = iters if iters is not None else [iter(loader) for loader in loaders]
    steps = []
    for _ in range(num_steps):
        step = []
        for d, loader in enumerate(loaders):
            batch = next(iters[d], None)
            if batch is None:  # the pass ended: every replica starts the next one together
                iters[d] = iter(loader)
                batch = next(iters[d])
            step.append(global_row(batch))
        steps.append(step)
    return steps, iters


def replicas(root, dp, window, seed=7, rank=0, shuffle=True):
    return [CPLoader(root, "cp2-test", rank, CP, dp_rank=d, dp_size=dp, seed=seed, shuffle=shuffle,
                     balance_window=window) for d in range(dp)]


@pytest.mark.parametrize("dp", range(1, 9))
def test_every_sequence_once_per_epoch_and_the_same_windows_as_the_stream(planned, dp):
    dataset, costs = planned
    epochs = 3
    num_steps = -(-epochs * NUM // dp)
    stream, _ = run(replicas(dataset.root, dp, 0), num_steps)
    flat_stream = [r for step in stream for r in step]
    for window in (0, 1, 2, 3, 5, 16, 32):
        steps, _ = run(replicas(dataset.root, dp, window), num_steps)
        flat = [r for step in steps for r in step]
        for e in range(epochs):
            epoch = flat[e * NUM:(e + 1) * NUM]
            assert sorted(epoch) == list(range(NUM)), f"dp {dp} window {window} epoch {e}"
        # the windows: after the straddling step's share of the epoch, W steps at a time, same multiset
        begin = 0
        for e in range(epochs):
            end = (e + 1) * NUM
            size = window * dp if window and dp > 1 else NUM
            for a in range(begin, end, size):
                b = min(a + size, end)
                assert sorted(flat[a:b]) == sorted(flat_stream[a:b]), f"dp {dp} window {window} at {a}"
                if dp > 1 and window and (b - a) % dp == 0 and a % dp == 0:
                    assert step_max_sum(costs[flat[a:b]], dp) <= step_max_sum(costs[flat_stream[a:b]], dp) + 1e-6
            begin = -(-end // dp) * dp  # the next epoch's first window starts after its straddling step
        if window == 0 or dp == 1:
            assert flat == flat_stream, "balance off: the stream order"
        # every rank of a CP group walks the same order
        other, _ = run(replicas(dataset.root, dp, window, rank=1), num_steps)
        assert other == steps


def test_balance_is_deterministic_and_balances(planned):
    dataset, costs = planned
    dp, steps = 4, 2 * NUM // 4
    first, _ = run(replicas(dataset.root, dp, 3), steps)
    again, _ = run(replicas(dataset.root, dp, 3), steps)
    stream, _ = run(replicas(dataset.root, dp, 0), steps)
    other_seed, _ = run(replicas(dataset.root, dp, 3, seed=8), steps)
    assert first == again and first != stream and first != other_seed
    assert step_efficiency(costs[np.ravel(first)], dp) > step_efficiency(costs[np.ravel(stream)], dp)
    # without shuffle the steps of a window go from the most costly to the least
    unshuffled, _ = run(replicas(dataset.root, dp, 3, shuffle=False), 6)
    file_order, _ = run(replicas(dataset.root, dp, 0, shuffle=False), 6)
    for window in (unshuffled[:3], unshuffled[3:]):
        step_max = [costs[step].max() for step in window]
        assert step_max == sorted(step_max, reverse=True)
    assert sorted(np.ravel(unshuffled[:3])) == sorted(np.ravel(file_order[:3]))


@pytest.mark.parametrize("dp_before, dp_after", [(4, 4), (4, 2), (3, 5), (2, 1), (1, 3), (8, 3)])
@pytest.mark.parametrize("window", [2, 16])
def test_resume_exactly_also_with_another_dp(planned, dp_before, dp_after, window):
    dataset, _ = planned
    for steps_before in (1, 3, 7):
        loaders = replicas(dataset.root, dp_before, window)
        before, iters = run(loaders, steps_before)
        states = [json.loads(json.dumps(loader.state_dict())) for loader in loaders]
        assert all(s == states[0] for s in states), "the loader state is the same on every replica"
        if dp_before == dp_after:  # the uninterrupted run is the reference
            expected, _ = run(loaders, 12, iters)
        resumed = replicas(dataset.root, dp_after, window, seed=0)
        for loader in resumed:
            loader.load_state_dict(states[0])
        after, _ = run(resumed, -(-3 * NUM // dp_after))
        if dp_before == dp_after:
            assert after[:12] == expected, f"dp {dp_before} window {window} after {steps_before} steps"
        flat = [r for s in before for r in s] + [r for s in after for r in s]
        for e in range(2):  # nothing repeated or skipped across the change
            assert sorted(flat[e * NUM:(e + 1) * NUM]) == list(range(NUM)), \
                f"dp {dp_before} -> {dp_after}, window {window}, after {steps_before} steps, epoch {e}"


def test_a_state_from_before_balance_resumes_and_a_bad_window_is_refused(planned):
    dataset, _ = planned
    loaders = replicas(dataset.root, 2, 0)  # a run in stream order, as every run before balance was
    before, _ = run(loaders, 3)
    state = loaders[0].state_dict()
    legacy = {k: v for k, v in state.items() if k not in ("window", "balance_window")}
    resumed = replicas(dataset.root, 2, 4)
    for loader in resumed:
        loader.load_state_dict(legacy)
    after, _ = run(resumed, -(-NUM // 2))
    flat = [r for s in before for r in s] + [r for s in after for r in s]
    assert sorted(flat[:NUM]) == list(range(NUM))
    with pytest.raises(Exception, match="window"):
        resumed[0].load_state_dict({**state, "window": [0, NUM + 1, 2]})
    with pytest.raises(Exception, match="balance_window"):
        CPLoader(dataset.root, "cp2-test", 0, CP, balance_window=-1)


@pytest.mark.parametrize("dp, window", [(4, 2), (3, 16), (8, 1)])
def test_the_reporting_functions_replay_the_loaders_first_epoch(planned, dp, window):
    dataset, costs = planned
    steps, _ = run(replicas(dataset.root, dp, window, seed=9), -(-NUM // dp))
    stream = stream_rows(dataset.root, seed=9)
    assert sorted(stream.tolist()) == list(range(NUM))
    unbalanced, _ = run(replicas(dataset.root, dp, 0, seed=9), -(-NUM // dp))
    assert np.ravel(unbalanced)[:NUM].tolist() == stream.tolist()
    expected = stream[balanced_epoch(costs[stream], dp, window, seed=9)]
    assert np.ravel(steps)[:NUM].tolist() == expected.tolist()
