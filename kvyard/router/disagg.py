"""Conditional disaggregation at the router: whether a prompt is prefilled on a prefill worker, and where.

A prompt goes remote only when it is worth it: at least `disagg_threshold` of its tokens are cached on no
decode worker (a short or mostly cached prompt is cheaper to prefill where it decodes), and some prefill
worker has room (fewer than `max_prefills_in_flight` prompts in progress: a saturated prefill pool would
only add queueing to the time to first token). The prefill worker is chosen by the router's policy, so
its own prefix cache counts; the decode worker is then chosen by load (its cache will hold the prompt
once the KV arrives). Every decision is counted in `kvyard_router_disagg_decisions`.

If the prefill worker fails, the request still goes to a decode worker, which prefills it locally.
"""

import logging
from typing import Any

import httpx

from kvyard.router.config import RouterSettings
from kvyard.router.placement import Placement
from kvyard.router.policies import RouteRequest
from kvyard.router.registry import WorkerRegistry

log = logging.getLogger(__name__)


class RemotePrefill:
    def __init__(self, settings: RouterSettings, registry: WorkerRegistry, placement: Placement,
                 client: httpx.AsyncClient):
        self.s = settings
        self.registry = registry
        self.placement = placement
        self.client = client
        self.metrics = registry.metrics

    async def prefill(self, req: RouteRequest, token_ids: list[int] | None) -> dict[str, Any] | None:
        """The `kv_transfer_params` for the decode worker, or None: prefill where it decodes."""
        pool = self.placement.live("prefill")
        if not pool or not token_ids:
            return None  # no disaggregated deployment (or a request the router could not tokenize)
        decode = self.placement.live("decode")
        cached = max(self.placement.overlaps(req, decode).values(), default=0)
        if len(token_ids) - cached * (self.registry.block_size or 1) < self.s.disagg_threshold:
            self.metrics.disagg.labels("short").inc()
            return None
        free = [w for w in pool if w.prefills_in_flight < self.s.max_prefills_in_flight]
        d = self.placement.pick(req, live=free, count_hits=False)
        if d is None:
            self.metrics.disagg.labels("saturated").inc()
            return None
        self.placement.begin(d, req)
        d.worker.prefills_in_flight += 1
        try:
            r = await self.client.post(d.worker.url + "/kv/prefill", json={"prompt_token_ids": token_ids})
            r.raise_for_status()
            params = r.json()
        except (httpx.HTTPError, ValueError) as e:
            if isinstance(e, httpx.TransportError):
                self.registry.mark_dead(d.worker, f"{type(e).__name__}: {e}")
            self.metrics.disagg.labels("prefill_failed").inc()
            log.warning("prefill on %s failed (%s); the decode worker prefills locally", d.worker.url, e)
            return None
        finally:
            d.worker.prefills_in_flight -= 1
            self.placement.end(d, req)
        self.metrics.disagg.labels("remote").inc()
        return {k: params[k] for k in ("transfer_id", "endpoint", "num_blocks")}
