"""LoRA adapters over HTTP (#39): each is a model of its own in /v1/models, and, behind
`enable_lora_runtime_updates`, vLLM's `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`.

A request names an adapter by its `model`. Loading reads the adapter on the engine thread between steps; a bad
adapter is a 400 that names the file and the reason, and the server goes on serving what it served.
"""

from fastapi import FastAPI, Request, Response
from pydantic import StrictInt, StrictStr

from kvyard.lora.adapter import AdapterError
from kvyard.server.context import ServerContext
from kvyard.server.errors import APIError
from kvyard.server.protocol import ModelCard, OpenAIModel, read_body


class LoadLoraAdapterRequest(OpenAIModel):
    lora_name: StrictStr
    lora_path: StrictStr


class UnloadLoraAdapterRequest(OpenAIModel):
    lora_name: StrictStr
    lora_int_id: StrictInt | None = None  # vLLM's; adapters here are known by name


def adapter_cards(ctx: ServerContext) -> list[ModelCard]:
    """A card per served adapter, its parent the base model."""
    return [ModelCard(id=name, created=ctx.created, max_model_len=ctx.engine.max_model_len, root=served.path,
                      parent=ctx.model_name) for name, served in sorted(ctx.engine.lora_adapters.items())]


def _check_enabled(ctx: ServerContext) -> None:
    if not ctx.settings.enable_lora_runtime_updates:
        raise APIError(404, "runtime LoRA updates are off: start the server with --enable-lora-runtime-updates",
                       code="not_found")


def install_lora_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        _check_enabled(ctx)
        body = await read_body(request, LoadLoraAdapterRequest)
        if body.lora_name in (ctx.model_name, ctx.engine.model_name):
            raise APIError(400, f"{body.lora_name!r} is the base model's name", param="lora_name")
        try:
            await ctx.engine.load_lora(body.lora_name, body.lora_path)
        except AdapterError as e:
            raise APIError(400, str(e), param="lora_path", code="invalid_adapter") from e
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        _check_enabled(ctx)
        body = await read_body(request, UnloadLoraAdapterRequest)
        await ctx.engine.unload_lora(body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")
