"""The offline API: `LLM(model).generate(prompts, SamplingParams)`, plus streaming and chat."""

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from kvyard.config import EngineConfig
from kvyard.engine.llm_engine import LLMEngine
from kvyard.outputs import RequestOutput
from kvyard.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, config: EngineConfig | None = None, **engine_options: Any):
        if config is None:
            config = EngineConfig(**engine_options) if model is None else EngineConfig(model=model, **engine_options)
        self.engine = LLMEngine(config.offline())
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the worker ranks of a parallel replica (nothing else needs closing)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora: str | None | Sequence[str | None] = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; results come back in prompt order. `lora` names the LoRA
        adapter each prompt runs with (one name for all, or one per prompt; None: the base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        # n > 1 becomes n requests; each gets its own seed so seeded samples still differ.
        adapters = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        groups: list[list[str]] = []
        for prompt, p, adapter in zip(prompts, params_list, adapters, strict=True):
            copies = [replace(p, n=1, seed=None if p.seed is None else p.seed + i) for i in range(p.n)]
            groups.append([self.engine.add_request(prompt, c, lora=adapter) for c in copies])
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=sum(len(g) for g in groups), disable=not use_tqdm, desc="generate")
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [self._merge([finished[rid] for rid in ids]) for ids in groups]

    @staticmethod
    def _merge(parts: list[RequestOutput]) -> RequestOutput:
        first = parts[0]
        outputs = [replace(p.outputs[0], index=i) for i, p in enumerate(parts)]
        return replace(first, outputs=outputs)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield one increment per step until the request finishes (other requests may share the steps)."""
        rid = self.engine.add_request(prompt, params)
        while True:
            for out in self.engine.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return

    def chat_prompt(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **template_kwargs
        )

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None) -> RequestOutput:
        return self.generate([self.chat_prompt(messages)], params)[0]
