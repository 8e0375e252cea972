"""kvyard: an LLM inference engine with a paged KV cache and continuous batching."""

from kvyard.config import EngineConfig
from kvyard.llm import LLM
from kvyard.outputs import CompletionOutput, RequestOutput
from kvyard.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
