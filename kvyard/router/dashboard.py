"""The operator's console: `GET /dashboard` (one HTML page, a small script, no build step) fed by
`GET /dashboard/data`, a JSON snapshot of what the router knows: the replicas (role, health, load, KV
usage, prefix hit rate, repetition-guard trips), its routing decisions over the last minutes, and the
TTFT / ITL percentiles of the streams it relayed (kvyard/router/observed.py). The page polls the JSON
every two seconds and draws it; every figure on it is one of the JSON's, as shown.
"""

import time
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse

DECISION_WINDOW_S = 300  # the decisions the page counts


def snapshot(state: Any) -> dict[str, Any]:
    """What /dashboard/data returns; `state` is the app's RouterState."""
    reg, observed = state.registry, state.proxy.observed
    workers = [w.describe() for w in reg.workers.values()]
    return {
        "time": time.time(),
        "policy": state.settings.policy,
        "model": reg.model,
        "replicas": workers,
        "healthy": sum(w["status"] == "healthy" for w in workers),
        "decisions": observed.decisions_by_worker(time.time() - DECISION_WINDOW_S),
        "decision_window_s": DECISION_WINDOW_S,
        "latency": observed.latency(),
        "repetition_trips": sum(w["repetition_trips"] for w in workers),
    }


def add_dashboard_routes(app: FastAPI, state: Any) -> None:
    """`state()` gives the RouterState (it exists only once the app has started)."""
    page = resources.files("kvyard.router").joinpath("dashboard.html").read_text()

    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/dashboard/data")
    async def dashboard_data() -> JSONResponse:
        return JSONResponse(snapshot(state()))
