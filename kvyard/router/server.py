"""Running the router: load the workers' tokenizer, build the app, serve it under uvicorn."""

from typing import Any

import uvicorn

from kvyard.router.app import build_router_app
from kvyard.router.config import RouterSettings


def load_tokenizer(model: str) -> Any:
    """The tokenizer (with its chat template) of the model the workers serve; no weights are read."""
    from kvyard.loader.checkpoint import load_checkpoint
    from kvyard.loader.registry import resolve_model

    return load_checkpoint(resolve_model(model)).tokenizer


def serve_router(settings: RouterSettings, controller: Any = None) -> None:
    """Serve until Ctrl-C or SIGTERM (uvicorn's own handling: stop accepting, finish open requests)."""
    app = build_router_app(settings, load_tokenizer(settings.model), controller)
    uvicorn.run(
        app, host=settings.host, port=settings.port, log_level=settings.log_level, timeout_graceful_shutdown=5
    )
