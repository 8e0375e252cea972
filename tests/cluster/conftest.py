"""A simulated Ray cluster on loopback for the tests of kvyard/cluster: a head that runs only the driver (and
this process's router) and three 1-CPU worker nodes, each with one `replica-slot` (`kvyard bench ray`'s
cluster)."""

import pytest

from tests.router.conftest import tiny_path, tokenizer  # noqa: F401 - the same tiny model and tokenizer

SLOT = {"replica-slot": 1.0}  # a custom resource only the three worker nodes have


@pytest.fixture(scope="module")
def ray_cluster():
    pytest.importorskip("ray")
    from kvyard.bench.ray_route import simulated_cluster

    with simulated_cluster(3, 1, SLOT) as cluster:
        yield cluster, list(cluster.worker_nodes)
