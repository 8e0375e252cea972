"""The FastAPI app: OpenAI routes, health, metrics, guards and error handlers around one AsyncEngine.

The app does not own the engine: whoever built the engine shuts it down (`lifecycle.serve`), so tests
can put several apps with different settings in front of one engine.
"""

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from kvyard import __version__
from kvyard.server.async_engine import AsyncEngine
from kvyard.server.chat import create_chat_completion
from kvyard.server.completions import create_completion
from kvyard.server.config import ServerSettings
from kvyard.server.context import ServerContext
from kvyard.server.errors import InternalErrorMiddleware, install_error_handlers
from kvyard.server.guards import GuardMiddleware
from kvyard.server.kv_routes import install_kv_routes
from kvyard.server.lora_api import adapter_cards, install_lora_routes
from kvyard.server.openapi import install_openapi
from kvyard.server.protocol import ModelCard, ModelList
from kvyard.server.tokenize_api import install_tokenize_routes


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    ctx = ServerContext.build(engine, settings)
    # Every route takes the raw Request and validates the body itself; `install_openapi` describes the
    # bodies from the same models. No docs pages: the OpenAI API reference is the documentation.
    app = FastAPI(title="kvyard", version=__version__, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    install_openapi(app)
    app.state.ctx = ctx
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, drain=ctx.drain, metrics=ctx.metrics, api_key=settings.api_key,
                       max_body_bytes=settings.max_body_bytes, cluster_token=settings.cluster_token)
    app.add_middleware(InternalErrorMiddleware)  # added last: the outermost of ours, so it sees everything

    @app.get("/v1/models")
    async def list_models() -> Response:
        card = ModelCard(id=ctx.model_name, created=ctx.created, max_model_len=engine.max_model_len,
                         generation_defaults=ctx.generation_defaults, batch_invariant=engine.batch_invariant)
        return Response(ModelList(data=[card, *adapter_cards(ctx)]).model_dump_json(), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(request, ctx)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(request, ctx)

    install_tokenize_routes(app, ctx)  # vLLM's /tokenize and /detokenize
    install_lora_routes(app, ctx)  # vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter
    install_kv_routes(app, engine, settings, ctx.model_name, ctx.disagg)  # /kv/config, /kv/snapshot, event publisher

    @app.get("/health")
    async def health() -> JSONResponse:
        if ctx.drain.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not engine.is_running:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        if engine.restarting:  # a router takes this replica out of rotation until its ranks are back
            return JSONResponse({"status": "restarting ranks"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = ctx.metrics.render()
        return Response(body, media_type=content_type)

    return app
