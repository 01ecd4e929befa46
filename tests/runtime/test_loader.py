"""CPLoader: per-rank tokens, positions and labels across shard boundaries, resume, and every refusal."""

import json

import numpy as np
import pytest

from flashcp.errors import FlashcpError, StalePlanError
from flashcp.planner.plan import SequencePlan
from flashcp.runtime import CPLoader
from tests.emulate import random_plan
from tests.plans import write_dataset, write_plan

CONTEXT = 24
CP = 3


def random_doc_lens(rng, context_len):
    cuts = np.sort(rng.choice(np.arange(1, context_len), size=int(rng.integers(0, 6)), replace=False))
    return np.diff(np.r_[0, cuts, context_len])


@pytest.fixture
def planned(tmp_path):
    """A 2-file dataset (5 + 4 rows, row groups of 2) with a random cp-3 plan (plan row groups of 3)."""
    rng = np.random.default_rng(0)
    files = [[random_doc_lens(rng, CONTEXT) for _ in range(n)] for n in (5, 4)]
    dataset, tokens = write_dataset(tmp_path / "data", files, CONTEXT, rng, row_group_rows=2)
    plans = [[random_plan(lens, CP, rng, max_pieces=4, cut_prob=0.2) for lens in rows] for rows in files]
    write_plan(dataset, "cp3-test", plans, CP, row_group_rows=3)
    return dataset, files, tokens, plans


def expected_views(doc_lens, tokens, plan, rank):
    """(input_ids, position_ids, labels) of ``rank`` written out token by token."""
    ids, positions, labels = [], [], []
    doc_start = np.cumsum(doc_lens) - doc_lens
    for s in plan.rank_slice(rank):
        d = plan.shard_doc[s]
        for p in range(plan.shard_start[s], plan.shard_start[s] + plan.shard_len[s]):
            ids.append(tokens[doc_start[d] + p])
            positions.append(p)
            labels.append(tokens[doc_start[d] + p + 1] if p + 1 < doc_lens[d] else -100)
    return ids, positions, labels


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_rank_gets_its_tokens_positions_and_labels(planned, shuffle):
    dataset, files, tokens, plans = planned
    orders = []
    for rank in range(CP):
        loader = CPLoader(dataset.root, "cp3-test", rank, CP, seed=5, shuffle=shuffle)
        batches = list(loader)
        assert len(batches) == len(loader) == 9
        orders.append([(b.file_index, b.row) for b in batches])
        for b in batches:
            f, r = b.file_index, b.row
            lens, row_tokens, plan = files[f][r], tokens[f][r], plans[f][r]
            ids, positions, labels = expected_views(lens, row_tokens, plan, rank)
            assert b.input_ids.tolist() == ids
            assert b.position_ids.tolist() == positions
            assert b.labels.tolist() == labels
            assert b.attn.rank == rank and b.attn.num_tokens == len(ids)
            assert b.num_label_tokens == CONTEXT - len(lens)
    assert orders[0] == orders[1] == orders[2], "all ranks must walk the sequences in the same order"
    assert sorted(orders[0]) == [(f, r) for f in range(2) for r in range((5, 4)[f])]
    assert (orders[0] != sorted(orders[0])) == shuffle


def test_labels_and_positions_cross_shard_boundaries(tmp_path):
    # documents [4, 4]: doc 0 as [0,2) rank 1, [2,3) rank 0, [3,4) rank 1; doc 1 as [0,3) rank 0, [3,4) rank 1
    dataset, tokens = write_dataset(tmp_path / "data", [[np.array([4, 4])]], 8, np.random.default_rng(0))
    t = tokens[0][0].tolist()
    plan = SequencePlan.from_arrays([0, 0, 1, 0, 1], [2, 0, 0, 3, 3], [1, 2, 3, 1, 1], [0, 1, 0, 1, 1], 2)
    write_plan(dataset, "cp2-hand", [[plan]], 2)
    rank0 = next(iter(CPLoader(dataset.root, "cp2-hand", 0, 2)))
    rank1 = next(iter(CPLoader(dataset.root, "cp2-hand", 1, 2)))
    assert rank0.input_ids.tolist() == [t[2], t[4], t[5], t[6]]
    assert rank0.position_ids.tolist() == [2, 0, 1, 2]
    assert rank0.labels.tolist() == [t[3], t[5], t[6], t[7]]  # t[3] and t[7] live on rank 1
    assert rank1.input_ids.tolist() == [t[0], t[1], t[3], t[7]]
    assert rank1.position_ids.tolist() == [0, 1, 3, 3]
    assert rank1.labels.tolist() == [t[1], t[2], -100, -100]  # t[2] lives on rank 0
    assert rank0.attn.shard_local_only.tolist() == [False, True]
    assert rank0.num_label_tokens == rank1.num_label_tokens == 6


def test_resume_yields_the_same_batches(planned):
    dataset = planned[0]
    reference = CPLoader(dataset.root, "cp3-test", 1, CP, seed=3)
    epoch0 = [(b.file_index, b.row, b.input_ids.tolist()) for b in reference]
    epoch1 = [(b.file_index, b.row, b.input_ids.tolist()) for b in reference]
    assert reference.epoch == 2
    assert [e[:2] for e in epoch0] != [e[:2] for e in epoch1], "each epoch has its own order"
    stream = epoch0 + epoch1
    for stop in (0, 1, 4, 9, 11):
        loader = CPLoader(dataset.root, "cp3-test", 1, CP, seed=3)
        seen = []
        while len(seen) < stop:
            for b in loader:
                seen.append((b.file_index, b.row, b.input_ids.tolist()))
                if len(seen) == stop:
                    break
        state = json.loads(json.dumps(loader.state_dict()))
        resumed = CPLoader(dataset.root, "cp3-test", 1, CP, seed=999)
        resumed.load_state_dict(state)
        rest = []
        while len(seen) + len(rest) < len(stream):
            rest += [(b.file_index, b.row, b.input_ids.tolist()) for b in resumed]
        assert seen + rest == stream, f"resume after {stop} batches"


def test_refusals(planned, tmp_path):
    dataset, files, tokens, plans = planned
    with pytest.raises(FlashcpError, match="plan 'cp8-x' does not exist .*available: cp3-test"):
        CPLoader(dataset.root, "cp8-x", 0, CP)
    with pytest.raises(FlashcpError, match="was made for cp 3 but world_size is 4"):
        CPLoader(dataset.root, "cp3-test", 0, 4)
    with pytest.raises(FlashcpError, match=r"rank 3 is outside \[0, 3\)"):
        CPLoader(dataset.root, "cp3-test", 3, CP)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FlashcpError, match="has no manifest.json"):
        CPLoader(tmp_path / "empty", "cp3-test", 0, CP)
    loader = CPLoader(dataset.root, "cp3-test", 0, CP)
    with pytest.raises(FlashcpError, match="loader state is for plan 'other'"):
        loader.load_state_dict({**loader.state_dict(), "plan": "other"})

    # lengths-only dataset
    rng = np.random.default_rng(1)
    lengths_only, _ = write_dataset(tmp_path / "lengths", files, CONTEXT, rng, has_tokens=False)
    write_plan(lengths_only, "cp3-test", plans, CP)
    with pytest.raises(FlashcpError, match="lengths-only"):
        CPLoader(lengths_only.root, "cp3-test", 0, CP)

    # the data changes after planning: the plan is stale
    write_dataset(dataset.root, files, CONTEXT, np.random.default_rng(2), row_group_rows=2)
    with pytest.raises(StalePlanError, match="plan 'cp3-test' is stale"):
        CPLoader(dataset.root, "cp3-test", 0, CP)


def test_a_plan_that_does_not_fit_its_row_is_refused(tmp_path):
    rng = np.random.default_rng(4)
    files = [[np.array([CONTEXT]), np.array([10, CONTEXT - 10])]]
    dataset, _ = write_dataset(tmp_path / "data", files, CONTEXT, rng)
    swapped = [[random_plan(files[0][1], CP, rng), random_plan(files[0][0], CP, rng)]]
    write_plan(dataset, "cp3-bad", swapped, CP)
    with pytest.raises(FlashcpError, match="plan 'cp3-bad' does not fit row 0 of data file 0"):
        next(iter(CPLoader(dataset.root, "cp3-bad", 0, CP, shuffle=False)))


def test_reads_one_row_group_and_two_columns_at_a_time(planned, monkeypatch):
    import pyarrow.parquet as pq

    dataset = planned[0]
    reads = []
    original = pq.ParquetFile.read_row_group

    def recording(self, i, columns=None, **kwargs):
        reads.append((i, columns))
        return original(self, i, columns=columns, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", recording)
    monkeypatch.setattr(pq.ParquetFile, "read", lambda *a, **k: pytest.fail("a whole file was read"))
    loader = CPLoader(dataset.root, "cp3-test", 2, CP, shuffle=False)
    loader.load_state_dict({**loader.state_dict(), "position": 7})
    batches = list(loader)
    assert [(b.file_index, b.row) for b in batches] == [(1, 2), (1, 3)]
    assert reads == [(1, ["tokens", "doc_lens"])], "resuming reads only the row group it resumes in"


def stream(loader, num_steps):
    """(file, row) of the next ``num_steps`` batches of ``loader``, across epochs."""
    out = []
    while len(out) < num_steps:
        for b in loader:
            out.append((b.file_index, b.row))
            if len(out) == num_steps:
                break
    return out


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("dp", [1, 2, 3])
def test_data_parallel_replicas_share_every_epoch_exactly_once(planned, dp, shuffle):
    dataset = planned[0]
    num = 9
    single = stream(CPLoader(dataset.root, "cp3-test", 0, CP, seed=4, shuffle=shuffle), 3 * num)
    for e in range(3):
        assert sorted(single[e * num:(e + 1) * num]) == sorted(single[:num]), "an epoch is a permutation"
    steps = -(-3 * num // dp)  # whole steps covering three epochs
    replicas = []
    for d in range(dp):
        per_rank = [stream(CPLoader(dataset.root, "cp3-test", r, CP, dp_rank=d, dp_size=dp, seed=4,
                                    shuffle=shuffle, balance_window=0), steps) for r in range(CP)]
        assert per_rank[0] == per_rank[1] == per_rank[2], "every rank of a CP group gets the same sequence"
        replicas.append(per_rank[0])
    interleaved = [replicas[d][s] for s in range(steps) for d in range(dp)]
    # step s takes stream items [s*dp, (s+1)*dp): the leftover of an epoch shares a step with the next epoch
    assert interleaved[:3 * num] == single, f"dp {dp}: the replicas' steps are not the global stream"


def test_each_pass_ends_where_the_epochs_step_ends(planned):
    # 9 sequences, dp 2: the first pass has 5 steps, the fifth taking the next epoch's first sequence
    dataset = planned[0]
    loaders = [CPLoader(dataset.root, "cp3-test", 0, CP, dp_rank=d, dp_size=2, seed=1) for d in (0, 1)]
    passes = [[len(list(loader)) for _ in range(3)] for loader in loaders]
    assert passes[0] == passes[1] == [5, 4, 5], "every replica runs the same number of steps"
    assert loaders[0].state_dict() == loaders[1].state_dict()
    assert (loaders[0].epoch, loaders[0].position) == (3, 1)  # epoch 3's first sequence is taken


@pytest.mark.parametrize("dp_before, dp_after", [(2, 2), (2, 3), (3, 1), (1, 2)])
def test_resume_mid_epoch_with_the_same_or_another_dp_size(planned, dp_before, dp_after):
    dataset = planned[0]
    num = 9
    single = stream(CPLoader(dataset.root, "cp3-test", 1, CP, seed=6), 4 * num)
    for steps_before in (1, 4, 5):
        loaders = [CPLoader(dataset.root, "cp3-test", 1, CP, dp_rank=d, dp_size=dp_before, seed=6,
                            balance_window=0) for d in range(dp_before)]
        before = [stream(loader, steps_before) for loader in loaders]
        states = [json.loads(json.dumps(loader.state_dict())) for loader in loaders]
        assert all(s == states[0] for s in states), "the loader state is the same on every replica"
        resumed = [CPLoader(dataset.root, "cp3-test", 1, CP, dp_rank=d, dp_size=dp_after, seed=0,
                            balance_window=0) for d in range(dp_after)]
        for loader in resumed:
            loader.load_state_dict(states[0])
        steps_after = 6
        after = [stream(loader, steps_after) for loader in resumed]
        got = ([before[d][s] for s in range(steps_before) for d in range(dp_before)]
               + [after[d][s] for s in range(steps_after) for d in range(dp_after)])
        assert got == single[:len(got)], f"dp {dp_before} -> {dp_after} after {steps_before} steps"


class FakeMesh:
    """The part of a DeviceMesh that CPLoader.from_mesh reads."""

    def __init__(self, names, sizes, local):
        self.mesh_dim_names, self.sizes, self.local = names, sizes, local

    def size(self, dim):
        return self.sizes[dim]

    def get_local_rank(self, name):
        return self.local[self.mesh_dim_names.index(name)]


def test_from_mesh_and_data_parallel_refusals(planned):
    dataset = planned[0]
    loader = CPLoader.from_mesh(dataset.root, "cp3-test", FakeMesh(("dp", "cp"), (2, 3), (1, 2)))
    assert (loader.dp_rank, loader.dp_size, loader.rank, loader.world_size) == (1, 2, 2, 3)
    loader = CPLoader.from_mesh(dataset.root, "cp3-test", FakeMesh(("cp",), (3,), (1,)), dp_dim=None)
    assert (loader.dp_rank, loader.dp_size, loader.rank) == (0, 1, 1)
    with pytest.raises(FlashcpError, match=r"dimensions \['data', 'cp'\] but the loader needs 'dp'; build"):
        CPLoader.from_mesh(dataset.root, "cp3-test", FakeMesh(("data", "cp"), (2, 3), (0, 0)))
    with pytest.raises(FlashcpError, match="made for cp 3 but the device mesh's 'cp' dimension has 2 ranks"):
        CPLoader.from_mesh(dataset.root, "cp3-test", FakeMesh(("dp", "cp"), (3, 2), (0, 0)))
    with pytest.raises(FlashcpError, match=r"dp_rank 2 is outside \[0, 2\)"):
        CPLoader(dataset.root, "cp3-test", 0, CP, dp_rank=2, dp_size=2)
    with pytest.raises(FlashcpError, match="dp_size must be at least 1, got 0"):
        CPLoader(dataset.root, "cp3-test", 0, CP, dp_size=0)
