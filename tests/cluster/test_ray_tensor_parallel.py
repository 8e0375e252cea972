"""A tensor-parallel replica placed by Ray on the simulated cluster (loopback only): one placement group with a
bundle per rank, rank 0 (the replica's engine and server) in the first, rank 1 a Ray actor on another node; the
ranks reach each other over gloo and the steps over ZeroMQ. It serves the single process's greedy text."""

import pytest

ray = pytest.importorskip("ray")
from ray.util.placement_group import placement_group_table  # noqa: E402

from kvyard import LLM, SamplingParams  # noqa: E402
from kvyard.cluster.ranks import rank_actor_name  # noqa: E402
from tests.cluster.test_ray_cluster import PROMPTS, controller_for, greedy_texts  # noqa: E402


def test_a_two_rank_replica_spans_two_nodes_and_gives_the_single_process_text(ray_cluster, tiny_path):
    with LLM(str(tiny_path), dtype="float32") as single:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        want = [o.outputs[0].text for o in single.generate(PROMPTS, params)]
    controller = controller_for(str(tiny_path), ["both"])
    controller.serve_argv += ["--tensor-parallel-size", "2"]
    try:
        [url] = controller.start_all()
        bundles = placement_group_table(controller.replicas[0].pg)["bundles_to_node_id"]
        assert len(bundles) == 2 and bundles[0] != bundles[1]  # a bundle per rank, on two nodes
        assert controller.replicas[0].node_id == bundles[0]  # rank 0, the replica actor, in the first
        assert greedy_texts(url, str(tiny_path)) == want
        rank1 = ray.get_actor(rank_actor_name(controller.replicas[0].pg, 1))
        assert ray.get(rank1.node_id.remote(), timeout=30) == bundles[1]  # rank 1: a Ray actor in the second
    finally:
        controller.stop()
