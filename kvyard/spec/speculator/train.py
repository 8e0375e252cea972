"""`kvyard speculator train`: distil the target's outputs into a few-layer drafter, then save it.

Steps: generate the data with the engine (`distill.py`), pick the draft vocabulary from the target's
output token counts, initialise the drafter's layers from the target's, fit them to the target's soft
(top-20) or hard (argmax) next-token targets on output positions, and estimate on held-out samples what
the engine will see: for a drafter that reads only tokens, drafting continues only while every earlier
draft was right, so the accepted run from a position is the run of teacher-forced argmax matches there.
"""

import pickle
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvyard.llm import LLM
from kvyard.loader.checkpoint import Checkpoint, load_checkpoint
from kvyard.loader.registry import resolve_model
from kvyard.spec.speculator.config import TrainConfig
from kvyard.spec.speculator.distill import Sample, distill, output_token_counts
from kvyard.spec.speculator.evaluate import evaluate
from kvyard.spec.speculator.format import EMBED, HEAD, SpeculatorConfig, save_speculator, target_fingerprint
from kvyard.spec.speculator.model import Drafter, choose_draft_vocab
from kvyard.spec.speculator.prompts import read_prompts
from kvyard.training import batches, step, warmup_cosine


def train_speculator(cfg: TrainConfig) -> dict:
    """Run the whole pipeline; returns the training summary also stored in speculator.json."""
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    samples = generate_data(cfg)
    gen_s = time.perf_counter() - t0
    random.Random(cfg.seed).shuffle(samples)
    n_eval = max(1, int(len(samples) * cfg.holdout)) if len(samples) > 1 else 0
    held, train = samples[:n_eval], samples[n_eval:]

    ckpt = load_checkpoint(resolve_model(cfg.target))
    layers = [i % ckpt.config.num_layers for i in cfg.init_layers]
    tensors = target_tensors(ckpt, layers)
    always = ckpt.config.eos_token_ids  # a draft may end the output
    token_map = choose_draft_vocab(output_token_counts(train), ckpt.config.vocab_size, cfg.draft_vocab, always)
    drafter = Drafter.from_target(ckpt.hf_config, tensors, layers, token_map)
    fingerprint = target_fingerprint(ckpt.hf_config, tensors[EMBED])
    del tensors

    t1 = time.perf_counter()
    losses = fit(drafter, train, cfg)
    train_s = time.perf_counter() - t1
    summary = {
        "prompts_file": str(cfg.prompts),
        "samples": len(train),
        "heldout_samples": len(held),
        "output_tokens": sum(s.num_output for s in train),
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "loss": cfg.loss,
        "epochs": cfg.epochs,
        "lr": cfg.lr,
        "final_loss": losses[-1] if losses else None,
        "generate_seconds": round(gen_s, 1),
        "train_seconds": round(train_s, 1),
        "heldout": evaluate(drafter, held) if held else {},
    }
    spec_cfg = SpeculatorConfig(
        target_name=cfg.target,
        target_fingerprint=fingerprint,
        hf_config=drafter.hf_config,
        init_layers=layers,
        draft_vocab_size=len(token_map),
        prompt_lookup=cfg.prompt_lookup,
        training=summary,
    )
    save_speculator(Path(cfg.out).expanduser(), spec_cfg, drafter.trained_weights())
    return summary


def generate_data(cfg: TrainConfig) -> list[Sample]:
    cache = Path(cfg.data_cache).expanduser() if cfg.data_cache else None
    if cache is not None and cache.is_file():
        with cache.open("rb") as f:
            return pickle.load(f)
    llm = LLM(cfg.target, dtype=cfg.dtype, kv_cache_memory=cfg.kv_cache_memory)
    prompts = read_prompts(cfg.prompts, llm.tokenizer, cfg.num_prompts)
    samples = distill(llm, prompts, cfg.max_tokens, cfg.temperature, cfg.seed, cfg.progress)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        with cache.open("wb") as f:
            pickle.dump(samples, f)
    return samples


def target_tensors(ckpt: Checkpoint, layers: list[int]) -> dict[str, torch.Tensor]:
    """The target's tensors the drafter starts from, in float32: embeddings, head, final norm, `layers`."""
    wanted = tuple(f"model.layers.{i}." for i in layers)
    out = {}
    for name, t in ckpt.tensors():
        if name in (EMBED, HEAD, "model.norm.weight") or name.startswith(wanted):
            out[name] = (t if isinstance(t, torch.Tensor) else t.dequantize()).float()
    return out


def _inputs(batch: list[Sample]) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Right-padded token ids, and per sample (row, first logits position, number of output positions)."""
    width = max(len(s.token_ids) for s in batch) - 1  # the last token predicts nothing
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    spans = []
    for row, s in enumerate(batch):
        ids[row, : len(s.token_ids) - 1] = torch.tensor(s.token_ids[:-1])
        spans.append((row, s.prompt_len - 1, s.num_output))
    return ids, spans


def _loss(drafter: Drafter, batch: list[Sample], inverse: torch.Tensor, soft: bool) -> torch.Tensor:
    ids, spans = _inputs(batch)
    logits = drafter(ids)
    rows = torch.cat([logits[r, p : p + n] for r, p, n in spans])
    logp = rows.log_softmax(-1)
    top_ids = torch.from_numpy(np.concatenate([s.top_ids for s in batch]))
    if not soft:
        labels = inverse[top_ids[:, 0]]
        return F.nll_loss(logp, labels, ignore_index=-1)
    top_lp = torch.from_numpy(np.concatenate([s.top_logprobs for s in batch]))
    cols = inverse[top_ids]
    probs = top_lp.exp() * (cols >= 0)
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-9)  # the target's top-K inside the draft vocab
    return -(probs * logp.gather(1, cols.clamp_min(0))).sum(-1).mean()


def _inverse(drafter: Drafter) -> torch.Tensor:
    inverse = torch.full((drafter.body.embed_tokens.weight.shape[0],), -1, dtype=torch.long)
    inverse[drafter.token_map] = torch.arange(len(drafter.token_map))
    return inverse


def fit(drafter: Drafter, samples: list[Sample], cfg: TrainConfig) -> list[float]:
    rng = random.Random(cfg.seed)
    inverse = _inverse(drafter)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    plan = [batches(samples, cfg.batch_tokens, rng, lambda s: len(s.token_ids)) for _ in range(cfg.epochs)]
    total = sum(len(p) for p in plan)
    warmup = max(1, total // 20)
    sched = warmup_cosine(opt, total, warmup)
    drafter.train()
    losses: list[float] = []
    bar = tqdm(total=total, desc="train", disable=not cfg.progress)
    for epoch_batches in plan:
        for batch in epoch_batches:
            losses.append(step(_loss(drafter, batch, inverse, cfg.loss == "soft"), opt, sched, params))
            bar.update(1)
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    bar.close()
    drafter.eval()
    return losses
