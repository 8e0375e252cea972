"""The repetition detector, both sides of every rule, on SmolLM2's real token ids; and the engine hook."""

import pytest

from kvyard import LLM, SamplingParams
from kvyard.engine.repetition import Repetition, RepetitionDetection, RepetitionDetector, is_plain_text
from kvyard.errors import InvalidRequestError
from kvyard.tokenizer.detokenizer import Detokenizer

DEFAULTS = RepetitionDetection()
TOKENS_ONLY = RepetitionDetection(text_min_count=0)


@pytest.fixture(scope="module")
def tok(smollm2_engine):
    return smollm2_engine.tokenizer.backend_tokenizer  # SmolLM2's tokenizer, from the shared engine


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def feed(tok, text: str, settings: RepetitionDetection = DEFAULTS) -> tuple[int, Repetition] | None:
    """Tokenize `text` and feed it as the engine would; (tokens fed when it tripped, what) or None."""
    det = RepetitionDetector(settings, tok)
    detok = Detokenizer(tok, [], [], True)
    for n, t in enumerate(ids(tok, text), 1):
        detok.add(t)
        if (hit := det.add(t, detok.text)) is not None:
            return n, hit
    return None


# ---- token cycles ---------------------------------------------------------------------------------------


def test_same_token_run_trips_at_min_count(tok):
    assert ids(tok, " ha ha ha ha") == [ids(tok, " ha")[0]] * 4  # one token, four times
    assert feed(tok, " ha ha ha", TOKENS_ONLY) is None
    assert feed(tok, " ha ha ha ha", TOKENS_ONLY) == (4, Repetition("tokens", 1, 4))
    assert feed(tok, " ha ha ha ha ha", RepetitionDetection(min_count=6, text_min_count=0)) is None


def test_short_cycle_trips_after_min_count_repeats(tok):
    sentence = " Max was a big cat named Luna's own size."
    size = len(ids(tok, sentence))
    assert 2 <= size <= 16
    assert feed(tok, sentence * 3, TOKENS_ONLY) is None
    n, hit = feed(tok, sentence * 4, TOKENS_ONLY)
    assert hit == Repetition("tokens", size, 4) and n == 4 * size
    # Longer than max_pattern_size: only the text rule could see it.
    assert feed(tok, sentence * 6, RepetitionDetection(max_pattern_size=size - 1, text_min_count=0)) is None


LEGITIMATE = {
    "counting": ", ".join(str(i) for i in range(1, 120)),
    "numbered counting": "".join(f"{i}. {i}\n" for i in range(1, 60)),
    "indented code": "def f(x):\n" + "".join(
        f"{'    ' * d}if x > {d}:\n{'    ' * (d + 1)}x -= 1\n" for d in range(1, 12)
    ) + " " * 48 + "return x\n",
    "markdown table": "| a | b | c | d | e | f | g | h |\n|---|---|---|---|---|---|---|---|\n"
    + "| --- | --- | --- | --- | --- | --- | --- | --- |\n| 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 |\n",
    "separators": ("=" * 200 + "\nSection\n") * 3 + "-" * 120 + "\n" + "*" * 80,
    "zeros": "x = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]\ny = 1000000000000000000000000\n",
    "blank lines and braces": "int main() {\n  if (a) {\n    if (b) {\n      f();\n    }\n  }\n}\n\n\n\n\n",
    "ruby ends": "class A\n  def f\n    if x\n      y\n    end\n  end\nend\n",
    "list of distinct items": "".join(f"{i}. {w}\n" for i, w in enumerate(
        ["Apple", "Banana", "Cherry", "Date", "Elderberry", "Fig", "Grape", "Honeydew", "Kiwi"], 1)),
    "prose": "The cat sat on the mat. It was warm. The dog slept by the door. Later, the cat woke up "
    "and looked outside. The rain had stopped. The cat sat on the mat again.",
}


@pytest.mark.parametrize("name", sorted(LEGITIMATE))
def test_legitimate_repetition_does_not_trip(tok, name):
    assert feed(tok, LEGITIMATE[name]) is None


def test_a_letter_free_loop_still_trips_once_long_enough(tok):
    # "0.000..." forever: plain tokens, so it must cover plain_min_tokens (64) tokens first.
    n, hit = feed(tok, "0." + "0" * 200)
    assert hit.rule == "tokens" and 64 <= n <= 70
    assert feed(tok, "0." + "0" * 200, RepetitionDetection(plain_min_tokens=0)) == (6, Repetition("tokens", 1, 4))


def test_plain_is_decided_on_whole_characters():
    assert is_plain_text(" ---") and is_plain_text("\n    ") and is_plain_text("🎉") and is_plain_text("1,")
    assert not is_plain_text(" ha") and not is_plain_text("\ufffd") and not is_plain_text("")


def test_vllm_object_is_exact_token_ngrams(tok):
    assert RepetitionDetection.from_vllm(max_pattern_size=0, min_count=4) is None  # vLLM: 0 disables
    vllm = RepetitionDetection.from_vllm(max_pattern_size=8, min_count=4)
    assert (vllm.min_pattern_size, vllm.plain_min_tokens, vllm.text_min_count) == (1, 0, 0)
    # No exception for letter-free cycles: a table rule is a loop to vLLM, as it is there.
    assert feed(tok, "|---|---|---|---|---|", vllm) is not None
    # min_pattern_size 2: a single-token run is not a pattern it looks for (until it is a 2-cycle).
    two = RepetitionDetection.from_vllm(max_pattern_size=4, min_pattern_size=2, min_count=3)
    assert feed(tok, " ha ha ha ha ha", two) is None
    assert feed(tok, " ha ha ha ha ha ha", two) == (6, Repetition("tokens", 2, 3))


# ---- text cycles (near-loops) ----------------------------------------------------------------------------


def test_numbered_list_repeating_one_item_trips(tok):
    n, hit = feed(tok, "1. Apple\n2. Banana\n3. Honeybees\n4. Honeybees\n5. Honeybees\n6. Honeybees\n")
    assert hit == Repetition("text", 1, 3)
    assert feed(tok, "1. Apple\n2. Banana\n3. Honeybees\n4. Honeybees\n") is None
    # Bullets and case changes too.
    assert feed(tok, "- apple\n* Apple\n- APPLE\n")[1] == Repetition("text", 1, 3)


def test_sentence_with_case_and_whitespace_changes_trips(tok):
    text = "Max was a big cat. max was a  big cat! MAX  was a big\tcat. Max was a big cat."
    assert feed(tok, text, TOKENS_ONLY) is None  # no exact token cycle
    assert feed(tok, text)[1] == Repetition("text", 1, 3)


def test_paragraph_cycle_trips(tok):
    # SmolLM2's own loop: two sentences, over and over, longer than any token cycle it looks for.
    para = ("The Romans added their own twist to the ancient traditions. They blended their own culture "
            "with the Mediterranean's diverse influences.\n\n")
    assert feed(tok, para * 2) is None
    assert feed(tok, para * 3)[1] == Repetition("text", 2, 3)


def test_text_rule_settings(tok):
    text = "1. Apple\n2. Apple\n3. Apple\n"
    assert feed(tok, text, RepetitionDetection(text_min_count=4)) is None
    assert feed(tok, text, RepetitionDetection(text_min_count=2))[1].count == 2


def test_state_stays_bounded(tok):
    """A long output with no loop: every token of " w0 w1 ... w2999" (no sentence ends, no newlines, no
    token cycle) never trips, the state stays bounded, and a real loop afterwards still trips."""
    det = RepetitionDetector(RepetitionDetection(), tok)
    text = ""
    for i in range(3000):
        for t in ids(tok, f" w{i}"):
            text += tok.decode([t])
            assert det.add(t, text) is None, (i, text[-40:])
    assert len(det._tokens.tail) <= 2 * 16 + 1 and len(det._text._buffer) <= 600
    ha = ids(tok, " ha")[0]
    hits = [det.add(ha, text) for _ in range(4)]
    assert hits[:3] == [None] * 3 and hits[3] == Repetition("tokens", 1, 4)


# ---- validation and the engine hook ---------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [("min_count", 1), ("min_count", True), ("max_pattern_size", 0),
                                              ("max_pattern_size", 65), ("min_pattern_size", 0),
                                              ("text_min_count", 1), ("text_max_period", 0),
                                              ("plain_min_tokens", -1)])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(repetition_detection=RepetitionDetection(**{field: value}))
    assert e.value.param == f"repetition_detection.{field}"


def test_settings_shorthand_and_cross_checks():
    assert SamplingParams(repetition_detection={"min_count": 5}).repetition_detection.min_count == 5
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(repetition_detection={"min_cuont": 5})
    assert e.value.param == "repetition_detection.min_cuont"
    with pytest.raises(InvalidRequestError) as e:
        RepetitionDetection.from_vllm(max_pattern_size=2, min_pattern_size=3, min_count=3).validate()
    assert e.value.param == "repetition_detection.min_pattern_size"


def test_engine_finishes_a_loop_with_repetition(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", kv_cache_memory="4MiB")
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    free = llm.generate("hello hello", greedy)[0].outputs[0].token_ids
    det = RepetitionDetector(RepetitionDetection(min_count=2, plain_min_tokens=0, text_min_count=0))
    trip = next((i for i, t in enumerate(free, 1) if det.add(t)), None)
    assert trip is not None and trip < 20, "the random model was expected to loop at once"
    guarded = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_detection=det.settings)
    out = llm.generate("hello hello", guarded)[0].outputs[0]
    assert out.finish_reason == "repetition" and out.token_ids == free[:trip]
    # Like a stop, it acts only once min_tokens are out.
    late = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, min_tokens=trip + 3,
                          repetition_detection=det.settings)
    out = llm.generate("hello hello", late)[0].outputs[0]
    assert len(out.token_ids) >= trip + 3 and out.token_ids[: trip + 3] == free[: trip + 3]
