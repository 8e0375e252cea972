"""One placement group per replica, reserved with a deadline: an unsatisfiable request fails fast and says
what was asked for and what the cluster has, instead of waiting forever (Ray's own default)."""

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from kvyard.errors import KvyardError


class PlacementError(KvyardError):
    """A replica's resources could not be reserved on the cluster within the timeout."""


def reserve(bundle: dict[str, float], strategy: str, timeout: float, name: str = "", count: int = 1) -> PlacementGroup:
    """`count` bundles alike: one per rank of a tensor-parallel replica (kvyard/cluster/ranks.py)."""
    pg = placement_group([bundle] * count, strategy=strategy, name=name)
    ready, _ = ray.wait([pg.ready()], timeout=timeout)
    if ready:
        return pg
    remove_placement_group(pg)
    total, free = ray.cluster_resources(), ray.available_resources()
    missing = {k: v for k, v in bundle.items() if free.get(k, 0.0) < v}
    raise PlacementError(
        f"could not place a replica asking for {f'{count} x ' if count > 1 else ''}{_fmt(bundle)} within {timeout:g} s: "
        f"missing {_fmt(missing) or 'nothing free on one node'}; the cluster has {_fmt(total)} "
        f"({_fmt(free)} free)"
    )


def _fmt(resources: dict[str, float]) -> str:
    # Leave out per-node markers, memory, and the resources Ray makes for each placement group's bundles.
    keep = {k: v for k, v in resources.items()
            if not k.startswith(("node:", "bundle_group_")) and "memory" not in k and "_group_" not in k}
    return ", ".join(f"{k}={v:g}" for k, v in sorted(keep.items()))
