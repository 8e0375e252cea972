"""Everything a request handler needs, built once per app and kept on `app.state.ctx`."""

import copy
import time
from dataclasses import dataclass, field

from kvyard.server.async_engine import AsyncEngine
from kvyard.server.config import ServerSettings
from kvyard.server.disagg import Disaggregation
from kvyard.server.errors import APIError
from kvyard.server.guards import Admission, DrainState
from kvyard.server.metrics import CaptureCollector, ServerMetrics, VisionCollector
from kvyard.server.structured import GrammarService
from kvyard.server.tokenization import FrontendTokenizer
from kvyard.shadow.capture import CaptureSettings, TraceCapture, config_fingerprint
from kvyard.vision.runtime import VisionGraft


@dataclass
class ServerContext:
    engine: AsyncEngine
    settings: ServerSettings
    metrics: ServerMetrics
    tokenizer: FrontendTokenizer
    admission: Admission
    drain: DrainState
    model_name: str
    grammars: GrammarService
    disagg: Disaggregation
    # What a request that leaves a sampling parameter out gets (settings.generation_config)
    generation_defaults: dict[str, float | int] = field(default_factory=dict)
    capture: TraceCapture | None = None  # settings.capture: sampled requests to JSON lines
    vision: VisionGraft | None = None  # settings.graft: images in chat requests become soft tokens
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if self.capture is not None:
            self.metrics.registry.register(CaptureCollector(self.capture))
        if self.vision is not None:
            self.metrics.registry.register(VisionCollector(self.vision))

    @classmethod
    def build(cls, engine: AsyncEngine, settings: ServerSettings) -> "ServerContext":
        metrics = ServerMetrics(engine.stats)
        tokenizer = FrontendTokenizer(engine.tokenizer)
        return cls(
            engine=engine,
            settings=settings,
            metrics=metrics,
            tokenizer=tokenizer,
            admission=Admission(engine, settings.max_queue),
            drain=DrainState(),
            model_name=settings.served_model_name or engine.model_name,
            grammars=GrammarService(engine, tokenizer, json_whitespace=settings.json_whitespace),
            disagg=Disaggregation(engine, settings, metrics.registry),
            generation_defaults=dict(engine.generation_defaults) if settings.generation_config == "auto" else {},
            capture=None if not isinstance(settings.capture, CaptureSettings) else TraceCapture(
                settings.capture, settings.served_model_name or engine.model_name, f"{settings.host}:{settings.port}",
                config_fingerprint(engine.engine_config), copy.deepcopy(engine.tokenizer).decode),
            vision=VisionGraft(settings.graft, engine.model_config.hidden_size) if settings.graft else None,
        )

    def check_model(self, name: str | None) -> str:
        """The name to answer with: the base model's (its engine name is an alias), or a LoRA adapter's."""
        if name is None or name in (self.model_name, self.engine.model_name):
            return self.model_name
        if name in self.engine.lora_adapters:
            return name
        adapters = f" and the LoRA adapters {', '.join(sorted(self.engine.lora_adapters))}" \
            if self.engine.lora_adapters else ""
        raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}{adapters}",
                       param="model", code="model_not_found")

    def adapter_of(self, model: str) -> str | None:
        """The LoRA adapter a request for `model` (as check_model answered) runs with; None: the base model."""
        return model if model != self.model_name and model in self.engine.lora_adapters else None
