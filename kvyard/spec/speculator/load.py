"""A speculator directory as the engine's drafter: a small DecoderModel on its own paged KV.

The embedding (and an untied LM head) come from the target checkpoint, whose fingerprint must match the
one recorded at training; the head is then cut down to the draft vocabulary, so each draft token costs
the drafter's few layers plus draft_vocab x hidden multiply-adds instead of the full head. With
`prompt_lookup` (the default), requests whose context repeats itself draft by lookup instead.
"""

from itertools import chain
from pathlib import Path

import torch

from kvyard.engine.kv_cache import allocate_kv_caches
from kvyard.loader.checkpoint import load_checkpoint
from kvyard.loader.registry import resolve_model
from kvyard.models.build import build_model
from kvyard.models.config import ModelConfig
from kvyard.spec.draft_model import DraftModelProposer
from kvyard.spec.ngram import LookupFirst, NgramProposer
from kvyard.spec.proposer import Proposer
from kvyard.spec.speculator.format import (
    CONFIG_NAME,
    EMBED,
    LOOKUP_MAX_N,
    LOOKUP_MIN_N,
    TOKEN_MAP,
    check_target,
    read_speculator_config,
    read_weights,
    shared_tensors,
    target_fingerprint,
)


def load_speculator(
    directory: str | Path,
    target: str,
    dtype: torch.dtype,
    device: torch.device,
    num_blocks: int,
    block_size: int,
    max_positions: int,
) -> Proposer:
    """Load `directory` as the drafter of `target`; SpeculatorMismatchError if it was trained for another one."""
    cfg = read_speculator_config(directory)
    ckpt = load_checkpoint(resolve_model(target))
    shared = shared_tensors(ckpt.tensors(), ckpt.config.tie_word_embeddings)
    check_target(cfg, directory, target, target_fingerprint(ckpt.hf_config, shared[EMBED]))
    weights = read_weights(directory)
    token_map = weights.pop(TOKEN_MAP).to(device)
    config = ModelConfig.from_hf(cfg.hf_config, str(Path(directory) / CONFIG_NAME))
    model = build_model(config, dtype, device, max_positions=max_positions)
    model.load(chain(shared.items(), weights.items()), str(directory))
    if len(token_map) < config.vocab_size:
        model.lm_head = model.lm_head[token_map].contiguous()  # the embedding itself stays whole
    else:
        token_map = None
    kv = allocate_kv_caches(config, num_blocks, block_size, dtype, device)
    drafter = DraftModelProposer(model, kv, num_blocks, block_size, token_map=token_map)
    if not cfg.prompt_lookup:
        return drafter
    return LookupFirst(NgramProposer(LOOKUP_MIN_N, LOOKUP_MAX_N), drafter)
