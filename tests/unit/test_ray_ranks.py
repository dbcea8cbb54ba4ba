"""megappo.parallel.ray_launch's ranks from where Ray placed its actors: each node's ranks
consecutive (bundle 0's node first), LOCAL_RANK / LOCAL_WORLD_SIZE per node, MASTER_ADDR rank 0's
node, CUDA_VISIBLE_DEVICES the node's GPUs in local-rank order. tests/e2e/test_ray_launcher.py
checks the same on a real two-node cluster with one rank per node."""

from megappo.parallel.ray_launch import _envs, _node_order


def test_interleaved_bundles_become_consecutive_ranks_per_node():
    # PACK put bundles 0, 2 on node A (10.0.0.1) and 1, 3 on node B (10.0.0.2)
    places = [("10.0.0.1", "A", ["0"]), ("10.0.0.2", "B", ["1"]), ("10.0.0.1", "A", ["1"]), ("10.0.0.2", "B", ["0"])]
    order = _node_order(places)
    assert order == [0, 2, 1, 3]  # ranks 0, 1 on A (a TP=2 group within a node), 2, 3 on B
    envs = _envs([places[i] for i in order], 29400, gpu=True)
    assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == \
        [("0", "0", "2"), ("1", "1", "2"), ("2", "0", "2"), ("3", "1", "2")]
    assert {e["MASTER_ADDR"] for e in envs} == {"10.0.0.1"} and {e["MASTER_PORT"] for e in envs} == {"29400"}
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "0,1", "1,0", "1,0"]  # LOCAL_RANK picks its own


def test_rank_zero_stays_on_bundle_zeros_node_and_cpu_ranks_get_no_gpu_list():
    places = [("10.0.0.2", "B", []), ("10.0.0.1", "A", []), ("10.0.0.2", "B", [])]
    order = _node_order(places)
    assert order == [0, 2, 1]
    envs = _envs([places[i] for i in order], 1, gpu=False)
    assert [(e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [("0", "2"), ("1", "2"), ("0", "1")]
    assert all(e["MASTER_ADDR"] == "10.0.0.2" and "CUDA_VISIBLE_DEVICES" not in e for e in envs)
