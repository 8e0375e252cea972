"""The trainable drafter: a few of the target's layers (HF modules, so autograd works) between the target's
frozen embeddings and its frozen LM head restricted to the draft vocabulary.

Training uses transformers' implementation of the target's architecture; serving loads the same
weights into kvyard's `DecoderModel` (`load.py`), whose HF tensor names they keep.
"""

from collections import Counter
from typing import Any

import torch
import transformers
from torch import nn

from kvyard.spec.speculator.format import EMBED, HEAD, TOKEN_MAP


def choose_draft_vocab(counts: Counter, vocab_size: int, size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` token ids the drafter may propose: the target's most frequent outputs (FR-Spec's idea).

    Tokens never seen in the outputs fill the rest by id: byte-level BPE numbers merges in the order it
    learnt them, so low ids are the common ones. `size` 0 or >= vocab_size keeps the whole vocabulary.
    """
    if size <= 0 or size >= vocab_size:
        return torch.arange(vocab_size)
    chosen = list(dict.fromkeys([t for t in always if 0 <= t < vocab_size] + [t for t, _ in counts.most_common()]))
    chosen = chosen[:size]
    seen = set(chosen)
    fill = (t for t in range(vocab_size) if t not in seen)
    while len(chosen) < size:
        chosen.append(next(fill))
    return torch.tensor(sorted(chosen))


def drafter_hf_config(target_hf_config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    cfg = dict(target_hf_config, num_hidden_layers=num_layers)
    cfg.pop("quantization_config", None)  # the drafter's own layers are dense
    return cfg


class Drafter(nn.Module):
    def __init__(self, hf_config: dict[str, Any], embed: torch.Tensor, head: torch.Tensor, token_map: torch.Tensor):
        super().__init__()
        self.hf_config = hf_config
        config = transformers.AutoConfig.for_model(**hf_config)
        self.body = transformers.AutoModel.from_config(config, attn_implementation="sdpa")
        self.body.embed_tokens.weight = nn.Parameter(embed.float(), requires_grad=False)
        self.register_buffer("token_map", token_map.long())
        self.register_buffer("head", head.float()[token_map].contiguous())

    @classmethod
    def from_target(cls, hf_config: dict[str, Any], tensors: dict[str, torch.Tensor], init_layers: list[int],
                    token_map: torch.Tensor) -> "Drafter":
        """Layers initialised from the target's layers `init_layers`; embeddings, norm and head from the target."""
        head = tensors.get(HEAD, tensors[EMBED])
        drafter = cls(drafter_hf_config(hf_config, len(init_layers)), tensors[EMBED], head, token_map)
        state = {"norm.weight": tensors["model.norm.weight"]}
        for mine, theirs in enumerate(init_layers):
            prefix = f"model.layers.{theirs}."
            state.update({f"layers.{mine}.{n[len(prefix):]}": t for n, t in tensors.items() if n.startswith(prefix)})
        missing, unexpected = drafter.body.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"embed_tokens.weight"}, (missing, unexpected)
        return drafter

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary, [batch, positions, draft_vocab] (right padding needs no mask)."""
        hidden = self.body(input_ids=input_ids).last_hidden_state
        return hidden @ self.head.T

    def trained_weights(self) -> dict[str, torch.Tensor]:
        """What a speculator directory stores: its layers and norm (HF names), and the draft vocabulary."""
        out = {"model." + n: p.detach().float() for n, p in self.body.named_parameters() if n != "embed_tokens.weight"}
        out[TOKEN_MAP] = self.token_map
        return out
