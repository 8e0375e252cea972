"""Builds the engine's speculative decoding from its config: which drafter, how many tokens."""

import torch
from transformers import PreTrainedTokenizerBase

from kvyard.config import EngineConfig
from kvyard.spec.decoding import SpeculativeDecoding
from kvyard.spec.ngram import NgramProposer
from kvyard.spec.proposer import Proposer


def make_speculation(
    cfg: EngineConfig,
    tokenizer: PreTrainedTokenizerBase,
    vocab_size: int,
    num_blocks: int,
    max_model_len: int,
) -> SpeculativeDecoding | None:
    if cfg.speculative_method is None:
        return None
    proposer: Proposer
    dtype = cfg.dtype if isinstance(cfg.dtype, torch.dtype) else torch.float32
    if cfg.speculative_method == "ngram":
        proposer = NgramProposer(cfg.ngram_min, cfg.ngram_max)
    elif cfg.speculative_method == "speculator":
        from kvyard.spec.speculator.load import load_speculator

        assert cfg.speculator is not None  # EngineConfig checks it
        proposer = load_speculator(cfg.speculator, cfg.model, dtype, torch.device(cfg.device), num_blocks,
                                   cfg.block_size, max_model_len)
    else:
        from kvyard.spec.draft_model import DraftModelProposer

        assert cfg.speculative_model is not None  # EngineConfig checks it
        proposer = DraftModelProposer.load(
            cfg.speculative_model,
            tokenizer,
            vocab_size,
            dtype,
            torch.device(cfg.device),
            num_blocks,
            cfg.block_size,
            max_model_len,
        )
    return SpeculativeDecoding(
        proposer,
        cfg.num_speculative_tokens,
        cfg.speculative_max_batch,
        max_model_len,
        adaptive=cfg.speculative_adaptive,
    )
