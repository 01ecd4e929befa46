import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from flashcp.data.dataset import Dataset
from flashcp.data.synth import (
    PILE_SUBSETS,
    _pile_mixture,
    load_distribution,
    pack_lengths,
    synth_dataset,
)
from flashcp.errors import FlashcpError


def naive_pack(lengths, context_len, num_seqs):
    """The paper's rule, one document at a time: append, truncate the one that overflows, start anew."""
    rows, current, fill, i = [], [], 0, 0
    while len(rows) < num_seqs:
        take = min(lengths[i], context_len - fill)
        current.append((take, i))
        fill += take
        i += 1
        if fill == context_len:
            rows.append(current)
            current, fill = [], 0
    return rows


@pytest.mark.parametrize("dist", ["wlb", "prolong"])
def test_pack_matches_naive_rule(dist):
    # empirical distributions draw indices with rng.integers, so a longer draw starts with a shorter one
    distribution = load_distribution(dist)
    offsets, lens, source, read, truncated = pack_lengths(distribution, np.random.default_rng(3), 40, 8192)
    drawn = distribution.draw(np.random.default_rng(3), read + 10)
    expected = naive_pack(drawn.tolist(), 8192, 40)
    got = [list(zip(lens[offsets[r]:offsets[r + 1]].tolist(), source[offsets[r]:offsets[r + 1]].tolist()))
           for r in range(40)]
    assert got == expected
    assert truncated == sum(1 for row in expected if row[-1][0] < drawn[row[-1][1]])
    assert read == expected[-1][-1][1] + 1


def test_pack_pile_invariants():
    offsets, lens, source, read, truncated = pack_lengths(load_distribution("pile"), np.random.default_rng(1),
                                                          200, 131072)
    assert (np.add.reduceat(lens, offsets[:-1]) == 131072).all()
    assert (np.diff(source) > 0).all(), "pieces come from distinct documents in draw order"
    assert read == source[-1] + 1 and 0 < truncated <= 200


def test_pack_many_batches_and_long_documents():
    # documents longer than the window: every window is one truncated document
    dist = load_distribution("pile")
    offsets, lens, _, _, _ = pack_lengths(dist, np.random.default_rng(0), 3000, 64)
    assert offsets.size == 3001
    assert (np.add.reduceat(lens, offsets[:-1]) == 64).all()
    assert (lens > 0).all()


def test_pile_mixture_keeps_byte_shares():
    probs, mean_tokens = _pile_mixture()
    assert probs.sum() == pytest.approx(1.0)
    shares = probs * mean_tokens / (probs * mean_tokens).sum()
    weights = np.array([w for _, w, _ in PILE_SUBSETS])
    assert np.allclose(shares, weights / weights.sum())
    lengths = load_distribution("pile").draw(np.random.default_rng(0), 200_000)
    assert lengths.min() >= 1
    assert lengths.mean() == pytest.approx(load_distribution("pile").mean_length(), rel=0.1)


def test_json_distribution(tmp_path):
    path = tmp_path / "lens.json"
    path.write_text(json.dumps([10, 20, 30]))
    dist = load_distribution(str(path))
    assert set(dist.draw(np.random.default_rng(0), 100).tolist()) <= {10, 20, 30}
    for bad in ("[]", "[1, 0]", "{\"a\": 1}", "[1.5]", "not json"):
        path.write_text(bad)
        with pytest.raises(FlashcpError, match="distribution file"):
            load_distribution(str(path))
    with pytest.raises(FlashcpError, match="unknown distribution 'zipf'"):
        load_distribution("zipf")


def test_synth_dataset_with_and_without_tokens(tmp_path):
    full = synth_dataset(tmp_path / "full", dist="wlb", num_seqs=30, context_len=4096, seed=5, vocab_size=100)
    lean = synth_dataset(tmp_path / "lean", dist="wlb", num_seqs=30, context_len=4096, seed=5,
                         with_tokens=False)
    assert full["has_tokens"] and not lean["has_tokens"]
    a, b = Dataset(tmp_path / "full"), Dataset(tmp_path / "lean")
    oa, la = a.read_doc_lens(0)
    ob, lb = b.read_doc_lens(0)
    assert np.array_equal(oa, ob) and np.array_equal(la, lb), "lengths do not depend on --no-tokens"
    table = pq.read_table(a.path(a.files[0]))
    tokens = table.column("tokens").combine_chunks()
    assert (np.diff(tokens.offsets.to_numpy()) == 4096).all()
    assert tokens.values.to_numpy().max() < 100
    assert "tokens" not in pq.read_schema(b.path(b.files[0])).names
    assert full["counts"]["documents_read"] == lean["counts"]["documents_read"] == la.size
    assert full["inputs"][0]["path"] == "flashcp/data/dists/wlb.json"


def test_synth_refuses_existing_folder_and_leaves_nothing_on_error(tmp_path):
    synth_dataset(tmp_path / "d", dist="prolong", num_seqs=2, context_len=1024, with_tokens=False)
    with pytest.raises(FlashcpError, match="already exists"):
        synth_dataset(tmp_path / "d", dist="prolong", num_seqs=2, context_len=1024)
    with pytest.raises(FlashcpError, match="unknown distribution"):
        synth_dataset(tmp_path / "e", dist="nope", num_seqs=2, context_len=1024)
    with pytest.raises(FlashcpError, match="--num-seqs"):
        synth_dataset(tmp_path / "e", dist="wlb", num_seqs=0, context_len=1024)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
