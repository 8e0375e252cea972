"""A draft model may only draft for a target whose tokenizer is the same: same ids, same special tokens."""

from transformers import PreTrainedTokenizerBase

from kvyard.errors import TokenizerMismatchError


def tokenizer_differences(
    target: PreTrainedTokenizerBase,
    draft: PreTrainedTokenizerBase,
    target_vocab_size: int,
    draft_vocab_size: int,
) -> list[str]:
    """What differs between the two tokenizers (and model vocabularies); empty when they are compatible."""
    problems: list[str] = []
    tv, dv = target.get_vocab(), draft.get_vocab()
    if tv != dv:
        differ = sum(1 for t, i in tv.items() if dv.get(t) != i) + sum(1 for t in dv if t not in tv)
        problems.append(f"vocabularies differ in {differ} tokens ({len(tv)} against {len(dv)})")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(target, name, None), getattr(draft, name, None)
        if a != b:
            problems.append(f"{name}: target {a}, draft {b}")
    ta = {i: t.content for i, t in target.added_tokens_decoder.items()}
    da = {i: t.content for i, t in draft.added_tokens_decoder.items()}
    if ta != da:
        problems.append(f"added/special tokens differ ({len(ta)} against {len(da)})")
    if target_vocab_size != draft_vocab_size:
        # A draft id past the target's embedding table could never be verified.
        problems.append(f"model vocab_size: target {target_vocab_size}, draft {draft_vocab_size}")
    return problems


def check_same_tokenizer(
    target: PreTrainedTokenizerBase,
    draft: PreTrainedTokenizerBase,
    target_vocab_size: int,
    draft_vocab_size: int,
    draft_name: str,
) -> None:
    problems = tokenizer_differences(target, draft, target_vocab_size, draft_vocab_size)
    if problems:
        raise TokenizerMismatchError(
            f"draft model {draft_name} cannot draft for this target, its tokenizer differs: "
            + "; ".join(problems)
        )
