"""DecoderModel.load: a missing weight is an error that names it, never a silent stand-in."""

import pytest
import torch

from kvyard.errors import CheckpointError
from kvyard.loader.checkpoint import load_checkpoint
from kvyard.models.decoder import DecoderModel


def test_an_untied_model_without_its_head_is_an_error(tiny_checkpoint):
    """Only a tied model may take its embedding table as the head; an untied one that lacks lm_head.weight must
    not quietly compute with the table instead."""
    ckpt = load_checkpoint(tiny_checkpoint("llama", tie_word_embeddings=False))
    model = DecoderModel(ckpt.config, torch.float32, torch.device("cpu"), max_positions=32)
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        model.load(((n, t) for n, t in ckpt.tensors() if n != "lm_head.weight"), "tiny")


def test_a_tied_model_takes_its_embedding_table_as_head(tiny_checkpoint):
    ckpt = load_checkpoint(tiny_checkpoint("llama", tie_word_embeddings=True))
    model = DecoderModel(ckpt.config, torch.float32, torch.device("cpu"), max_positions=32)
    model.load(ckpt.tensors(), "tiny")
    assert model.lm_head is model.embed
