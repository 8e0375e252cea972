"""`kvyard graft vision`: join a frozen image encoder to a frozen language model by training a small projector.

The prompt is a chat whose user turn is `<image>` and the question; the projector's soft tokens take the
placeholder's positions in the prompt's embeddings. Training data: easy-VQA's train split; the loss is the
answer's tokens' cross-entropy, the gradient reaching only the projector. The projector starts from a
least-squares fit (kvyard/vision/projector.py) to the embeddings of each training image's colour and shape
words. The report gives held-out exact-match accuracy, per question type, with the graft and for the same
model given the question alone, untrained (text only) and with a projector trained the same way on blank
images (blind: the answer format and the answers' priors, without the image). The output directory holds `graft.json`,
`projector.safetensors` and `report.json`.
"""

import json
import random
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvyard.training import right_pad
from kvyard.vision.config import PROJECTOR_FILE, GraftConfig
from kvyard.vision.easy_vqa import Question, read_split
from kvyard.vision.encoder import EfficientNetLite0, normalise
from kvyard.vision.images import file_pixels
from kvyard.vision.projector import Projector

PLACEHOLDER = "<image>"
IMAGE_SIZE = 64  # easy-VQA's images: what the projector is trained on, and what served images are resized to


@dataclass
class GraftSettings:
    out: str
    model: str = "smollm2-135m"
    encoder: str = "efficientnet-lite0"
    tokens: int = 4  # soft tokens per image
    width: int = 1024  # the projector's hidden layer
    train_questions: int = 8000  # drawn from easy-VQA's train split
    eval_questions: int = 600  # drawn from its test split
    epochs: int = 1
    batch: int = 32
    lr: float = 1e-3
    seed: int = 0
    progress: bool = True


@dataclass
class Prompt:
    ids: list[int]  # with `tokens` placeholder ids where the image goes
    image_at: int | None  # the first placeholder position; None: no image


class GraftFormat:
    """How a question becomes token ids, with or without an image, in the language model's chat template."""

    def __init__(self, tokenizer: Any, tokens: int):
        self.tokenizer, self.tokens = tokenizer, tokens
        self.placeholder_id = tokenizer.unk_token_id if tokenizer.unk_token_id is not None else 0

    def _text(self, question: str, with_image: bool, answer: str | None = None) -> tuple[str, str]:
        content = f"{PLACEHOLDER}\n{question}" if with_image else question
        turns = [{"role": "user", "content": content}]
        prompt = self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        if answer is None:
            return prompt, ""
        whole = self.tokenizer.apply_chat_template(turns + [{"role": "assistant", "content": answer}], tokenize=False)
        return prompt, whole[len(prompt):] if whole.startswith(prompt) else answer

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def prompt(self, question: str, with_image: bool) -> Prompt:
        text, _ = self._text(question, with_image)
        if not with_image:
            return Prompt(self._ids(text), None)
        before, after = text.split(PLACEHOLDER, 1)
        head = self._ids(before)
        return Prompt(head + [self.placeholder_id] * self.tokens + self._ids(after), len(head))

    def answer_ids(self, question: str, answer: str) -> list[int]:
        return self._ids(self._text(question, True, answer)[1])


def encode_images(encoder: EfficientNetLite0, paths: list[Path], batch: int = 64) -> dict[Path, torch.Tensor]:
    """Each image's encoder features ([1280, h, w]), computed once: the encoder is frozen."""
    out = {}
    with torch.no_grad():
        for start in range(0, len(paths), batch):
            chunk = paths[start : start + batch]
            pixels = torch.stack([file_pixels(p, IMAGE_SIZE) for p in chunk])
            for p, f in zip(chunk, encoder.features(normalise(pixels)), strict=True):
                out[p] = f
    return out


def describing_words(questions: list[Question]) -> dict[Path, str]:
    """Per image, "colour shape" from the answers to its colour and shape questions (where it has both)."""
    found: dict[Path, dict[str, str]] = defaultdict(dict)
    for q in questions:
        if q.kind != "yes/no":
            found[q.image][q.kind] = q.answer
    return {img: f" {w['colour']} {w['shape']}" for img, w in found.items() if len(w) == 2}


def _targets(lm: Any, fmt: GraftFormat, words: list[str]) -> torch.Tensor:
    """[n, tokens, hidden]: the embeddings of each description's tokens, repeated to fill the soft tokens."""
    table = lm.get_input_embeddings().weight
    rows = []
    for text in words:
        ids = fmt._ids(text)
        rows.append(table[[ids[i % len(ids)] for i in range(fmt.tokens)]])
    return torch.stack(rows).detach()


def embeddings(lm: Any, prompts: list[Prompt], soft: torch.Tensor | None, tails: list[list[int]], pad: int
               ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Right-padded input embeddings with the soft tokens in place, the attention mask, and each row's length."""
    rows = [p.ids + t for p, t in zip(prompts, tails, strict=True)]
    ids, mask = right_pad(rows, pad)
    embeds = lm.get_input_embeddings()(ids)
    if soft is not None:
        at = torch.tensor([p.image_at for p in prompts])
        index = (at[:, None] + torch.arange(soft.shape[1])[None]).unsqueeze(-1).expand(-1, -1, embeds.shape[-1])
        embeds = embeds.scatter(1, index, soft.to(embeds.dtype))
    return embeds, mask, [len(r) for r in rows]


def train_graft(s: GraftSettings) -> dict[str, Any]:
    from safetensors.torch import save_file

    from kvyard.loader.checkpoint import load_checkpoint
    from kvyard.loader.hf_model import hf_causal_lm
    from kvyard.loader.registry import resolve_model
    from kvyard.vision.encoder import HEAD_CHANNELS, load_encoder

    started = time.perf_counter()
    rng = random.Random(s.seed)
    torch.manual_seed(s.seed)
    ckpt = load_checkpoint(resolve_model(s.model))
    lm = hf_causal_lm(ckpt.hf_config, {n: t.float() for n, t in ckpt.tensors()}).requires_grad_(False)
    encoder_path = resolve_model(s.encoder)
    encoder = load_encoder(encoder_path)
    fmt = GraftFormat(ckpt.tokenizer, s.tokens)
    all_train, all_test = read_split("train"), read_split("test")
    train = rng.sample(all_train, min(s.train_questions, len(all_train)))
    held = rng.sample(all_test, min(s.eval_questions, len(all_test)))
    features = encode_images(encoder, sorted({q.image for q in train} | {q.image for q in held}))
    words = describing_words(all_train)
    targets = {img: t for img, t in zip(sorted(words), _targets(lm, fmt, [words[i] for i in sorted(words)]),
                                        strict=True)}
    projector, losses, ls_error, before = _fit(lm, fmt, features, train, held, targets, s)
    after = evaluate(lm, projector, fmt, features, held, fmt.placeholder_id)
    # The same training with every image blank: what the answer format and the answers' priors give alone
    blank = {img: torch.zeros_like(f) for img, f in features.items()}
    blind, _, _, _ = _fit(lm, fmt, blank, train, held, targets, s, evaluate_first=False)
    blind_accuracy = evaluate(lm, blind, fmt, blank, held, fmt.placeholder_id)
    text_only = evaluate(lm, None, fmt, features, held, fmt.placeholder_id)
    out = Path(s.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in projector.state_dict().items()}, str(out / PROJECTOR_FILE))
    GraftConfig(model=_reference(s.model), encoder=_reference(s.encoder), tokens=s.tokens, width=s.width,
                feature_dim=HEAD_CHANNELS, hidden=lm.config.hidden_size, placeholder=PLACEHOLDER,
                placeholder_id=fmt.placeholder_id, image_size=IMAGE_SIZE).write(out)
    report = {"settings": asdict(s), "least_squares_relative_error": ls_error, "steps": len(losses),
              "first_loss": losses[0] if losses else None,
              "last_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
              "accuracy": {"graft_least_squares_only": before, "graft": after, "blind": blind_accuracy,
                           "text_only": text_only},
              "seconds": round(time.perf_counter() - started, 1)}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _reference(model: str) -> str:
    """How graft.json names a model: a registry name as it is (fetched where it is served), a path absolute."""
    return str(Path(model).expanduser().resolve()) if Path(model).expanduser().exists() else model


def _fit(lm: Any, fmt: GraftFormat, features: dict[Path, torch.Tensor], train: list[Question],
         held: list[Question], targets: dict[Path, torch.Tensor], s: GraftSettings, evaluate_first: bool = True,
         ) -> tuple[Projector, list[float], float, dict[str, float] | None]:
    """A projector fitted by least squares, then trained; returns it, the losses, the fit's relative error and
    (with `evaluate_first`) its held-out accuracy before training."""
    from kvyard.training import step, warmup_cosine
    from kvyard.vision.encoder import HEAD_CHANNELS

    projector = Projector(HEAD_CHANNELS, lm.config.hidden_size, s.tokens, s.width)
    fitted = [img for img in sorted({q.image for q in train}) if img in targets]
    ls_error = projector.fit_least_squares(torch.stack([features[i] for i in fitted]),
                                           torch.stack([targets[i] for i in fitted]))
    before = evaluate(lm, projector, fmt, features, held, fmt.placeholder_id) if evaluate_first else None
    plan = [train[i : i + s.batch] for _ in range(s.epochs) for i in range(0, len(train), s.batch)]
    params = list(projector.parameters())
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.0)
    sched = warmup_cosine(opt, len(plan), max(1, len(plan) // 20))
    losses: list[float] = []
    bar = tqdm(plan, desc="graft", disable=not s.progress)
    for batch in bar:
        losses.append(step(_loss(lm, projector, fmt, features, batch, fmt.placeholder_id), opt, sched, params))
        bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
    return projector.eval(), losses, ls_error, before


def _loss(lm: Any, projector: Projector, fmt: GraftFormat, features: dict[Path, torch.Tensor],
          batch: list[Question], pad: int) -> torch.Tensor:
    prompts = [fmt.prompt(q.question, True) for q in batch]
    answers = [fmt.answer_ids(q.question, q.answer) for q in batch]
    soft = projector(torch.stack([features[q.image] for q in batch]))
    embeds, mask, lengths = embeddings(lm, prompts, soft, answers, pad)
    logits = lm(inputs_embeds=embeds, attention_mask=mask).logits
    rows, targets = [], []
    for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        start = len(p.ids)
        rows.append(logits[i, start - 1 : start - 1 + len(a)])
        targets.append(torch.tensor(a))
    return torch.nn.functional.cross_entropy(torch.cat(rows), torch.cat(targets))


@torch.no_grad()
def evaluate(lm: Any, projector: Projector | None, fmt: GraftFormat, features: dict[Path, torch.Tensor],
             held: list[Question], pad: int, max_new_tokens: int = 4) -> dict[str, float]:
    """Exact-match accuracy of the greedy answer's first word, overall and per question type; `projector`
    None: the question alone, without the image."""
    hits: dict[str, list[bool]] = defaultdict(list)
    for q in held:
        prompt = fmt.prompt(q.question, projector is not None)
        soft = projector(features[q.image][None]) if projector is not None else None
        embeds, mask, _ = embeddings(lm, [prompt], soft, [[]], pad)
        out = lm.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=max_new_tokens,
                          do_sample=False, pad_token_id=pad)
        hit = answers(fmt.tokenizer.decode(out[0], skip_special_tokens=True), q.answer)
        hits[q.kind].append(hit)
        hits["all"].append(hit)
    return {kind: sum(h) / len(h) for kind, h in sorted(hits.items())}


def answers(text: str, answer: str) -> bool:
    """Exact match: the reply's first word, lower-cased and without trailing punctuation, is the answer."""
    words = text.strip().lower().split()
    return bool(words) and words[0].strip(".,!") == answer
