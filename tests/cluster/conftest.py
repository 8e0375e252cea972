"""A simulated Ray cluster on loopback for the tests of kvyard/cluster: a head that runs only the driver (and
this process's router) and three 1-CPU worker nodes, each with one `replica-slot`."""

import os

import pytest

from tests.router.conftest import tiny_path, tokenizer  # noqa: F401 - the same tiny model and tokenizer

SLOT = {"replica-slot": 1.0}  # a custom resource only the three worker nodes have


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"  # set by tests/conftest.py: loopback only
    fast_death = {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                  "health_check_initial_delay_ms": 0}
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False, "_system_config": fast_death})
    nodes = [cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", resources=SLOT) for _ in range(3)]
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    try:
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()
