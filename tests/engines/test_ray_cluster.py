"""``--engine ray`` on a two-node cluster (two Ray nodes on this machine): the same bytes as the local engine."""

from __future__ import annotations

import pytest

from tests.cli.pack_helpers import file_hashes
from tests.engines.corpus import make_corpus, pack_args, run

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")
import flashcp.engines.ray_pack as ray_pack  # noqa: E402  (with ray installed, an import failure is a failure)


@pytest.fixture(scope="module")
def two_nodes():
    if ray.is_initialized():
        ray.shutdown()
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_two_node_cluster_packs_and_plans_the_local_bytes(tmp_path, two_nodes, monkeypatch):
    monkeypatch.setattr(ray_pack, "SHARD_BYTES", 40_000)
    inputs = make_corpus(tmp_path / "in", seed=5)
    args = pack_args(inputs, 2048, "--tokenizer", "byte")
    assert run("pack", *args, "-o", tmp_path / "local", "--workers", "1").exit_code == 0
    result = run("pack", *args, "-o", tmp_path / "ray", "--engine", "ray", "--ray-address", two_nodes.address)
    assert result.exit_code == 0, result.output
    assert file_hashes(tmp_path / "ray") == file_hashes(tmp_path / "local")

    # the same again through the API, to see that both nodes tokenized. SPREAD is Ray's best effort: on a loaded
    # machine one pass may find the second node's only CPU busy with a write task, so up to three passes
    # (each the same bytes) must together have tokenized on both nodes.
    from flashcp.data.pack import PackConfig, run_pack

    ray.init(address=two_nodes.address, log_to_driver=False)
    nodes: set[str] = set()
    try:
        for attempt in range(3):
            engine = ray_pack.RayPackEngine()
            out = tmp_path / f"api{attempt}"
            config = PackConfig(inputs=tuple(map(str, inputs)), output=out, context_len=2048,
                                tokenizer="byte", rows_per_file=6, row_group_rows=4)
            run_pack(config, engine=engine)
            assert engine.cpus == 2
            assert file_hashes(out) == file_hashes(tmp_path / "local")
            nodes |= engine.nodes_used
            if len(nodes) == 2:
                break
    finally:
        ray.shutdown()
    assert len(nodes) == 2, nodes

    assert run("plan", tmp_path / "local", "--cp", "8").exit_code == 0
    result = run("plan", tmp_path / "ray", "--cp", "8", "--engine", "ray", "--ray-address", two_nodes.address)
    assert result.exit_code == 0, result.output
    assert file_hashes(tmp_path / "ray") == file_hashes(tmp_path / "local")
