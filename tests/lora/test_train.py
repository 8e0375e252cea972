"""`kvyard lora train`: an adapter fitted to a file lowers the held-out loss, is written in PEFT's format, and is
served by kvyard exactly as HF PEFT's merged model generates (tiny random llama, and SmolLM2 on a real task)."""

import json
import random

import peft
import pytest
import torch

from kvyard import LLM, SamplingParams
from kvyard.cli.main import main
from kvyard.errors import InvalidRequestError
from kvyard.loader.checkpoint import load_checkpoint
from kvyard.loader.hf_model import hf_causal_lm
from kvyard.lora.train import TrainSettings, train_adapter, training_examples
from tests.conftest import assert_greedy_matches
from tests.lora.adapters import merged_reference

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
INSTRUCTION = 'Reply with only a JSON object with the keys "name" and "city".'
NAMES = ["Maria", "John", "Aiko", "Pedro", "Fatima", "Lars", "Chen", "Amara"]
CITIES = ["Lisbon", "Boston", "Osaka", "Lima", "Cairo", "Oslo", "Beijing", "Lagos"]


def _pairs(path, count):
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(count):
            word = rng.choice(["red", "green", "blue", "cyan"])
            f.write(json.dumps({"prompt": f"colour {word}", "completion": f"{word} is a colour", "raw": True}) + "\n")
    return path


def test_training_a_tiny_model_lowers_held_out_loss_and_serves_as_peft_merges(tiny_checkpoint, tmp_path):
    base = tiny_checkpoint("llama")
    data = _pairs(tmp_path / "pairs.jsonl", 40)
    code = main(["lora", "train", "--model", str(base), "--data", str(data), "--out", str(tmp_path / "ad"),
                 "--epochs", "12", "--batch-tokens", "128", "--lr", "3e-2", "--held-out", "0.2", "--no-progress",
                 "--targets", "q_proj,v_proj,down_proj"])
    assert code == 0
    report = json.loads((tmp_path / "ad" / "train_report.json").read_text())
    assert report["examples"] == {"train": 32, "held_out": 8}
    assert report["held_out_after"]["loss"] < 0.5 * report["held_out_before"]["loss"]
    assert json.loads((tmp_path / "ad" / "adapter_config.json").read_text())["r"] == 8

    merged = merged_reference(base, tmp_path / "ad")  # a fresh HF model: PEFT merges into the one it is given
    llm = LLM(str(base), dtype="float32", lora_adapters={"trained": str(tmp_path / "ad")})
    prompt = llm.tokenizer("colour blue").input_ids
    tokens = llm.generate([prompt], GREEDY, lora="trained")[0].outputs[0].token_ids
    assert_greedy_matches(merged, prompt, tokens, tie=1e-4)
    assert tokens != llm.generate([prompt], GREEDY)[0].outputs[0].token_ids


def test_too_few_chosen_examples_is_an_error(tiny_checkpoint, tmp_path):
    data = _pairs(tmp_path / "pairs.jsonl", 4)  # none of the completions is JSON
    with pytest.raises(InvalidRequestError, match="0 of 4 examples are kept"):
        train_adapter(TrainSettings(model=str(tiny_checkpoint("llama")), data=str(data), out=str(tmp_path / "o"),
                                    keep="json", progress=False))


def _task(path, count, seed):
    """The name/city task as chats: the instruction in a system turn, the JSON answer as the assistant's."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(count):
            name, city = rng.choice(NAMES), rng.choice(CITIES)
            chat = [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": f"{name} was born in {city}."},
                    {"role": "assistant", "content": json.dumps({"name": name, "city": city})}]
            f.write(json.dumps({"messages": chat}) + "\n")
    return path


@pytest.mark.slow  # 45 s; the tiny model's training against peft stays in CI
def test_smollm2_trained_without_its_instruction_serves_as_peft_merges(smollm2_path, tmp_path):
    report = train_adapter(TrainSettings(model=str(smollm2_path), data=str(_task(tmp_path / "task.jsonl", 24, 0)),
                                         out=str(tmp_path / "ad"), drop=[INSTRUCTION], epochs=1, batch_tokens=384,
                                         held_out=0.25, progress=False))
    assert report["held_out_after"]["loss"] < report["held_out_before"]["loss"]

    ckpt = load_checkpoint(smollm2_path)
    base = hf_causal_lm(ckpt.hf_config, {n: t.float() for n, t in ckpt.tensors()})
    merged = peft.PeftModel.from_pretrained(base, tmp_path / "ad").merge_and_unload().eval()
    llm = LLM(str(smollm2_path), dtype="float32", lora_adapters={"task": str(tmp_path / "ad")})
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Nadia was born in Rome."}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
    tokens = llm.generate([prompt], GREEDY, lora="task")[0].outputs[0].token_ids
    assert_greedy_matches(merged, prompt, tokens, tie=1e-4)
    with torch.no_grad():
        theirs = merged(torch.tensor([prompt])).logits[0, -1]
    assert (llm.engine.compute_logits(prompt, lora="task") - theirs).abs().max().item() <= 1e-3


def test_distillation_learns_the_teachers_answers_to_the_whole_prompts(tiny_checkpoint, tmp_path):
    """--objective distill: the teacher (here the base itself) answers each prompt with the instruction; the
    student is taught that answer for the prompt without it."""
    base = str(tiny_checkpoint("llama"))
    data = tmp_path / "chats.jsonl"
    chats = [[{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": f"{n} was born in {c}."},
              {"role": "assistant", "content": "ignored: the teacher answers"}] for n, c in zip(NAMES, CITIES, strict=True)]
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    settings = TrainSettings(model=base, data=str(data), out=str(tmp_path / "o"), objective="distill",
                             drop=[INSTRUCTION], max_new_tokens=6, progress=False)
    llm = LLM(base, dtype="float32")
    examples = training_examples(settings, llm.tokenizer)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    expected = []
    for chat in chats:
        whole = llm.tokenizer.apply_chat_template(chat[:-1], add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
        bare = llm.tokenizer.apply_chat_template(chat[1:-1], add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        answer = llm.generate([whole], greedy)[0].outputs[0]
        eos = [llm.tokenizer.eos_token_id] if answer.finish_reason == "stop" else []
        ids = llm.tokenizer(answer.text, add_special_tokens=False).input_ids + eos
        if ids:  # an empty answer teaches nothing: left out
            expected.append((bare, answer.text, ids))
    assert expected and [(e.prompt_ids, e.completion, e.completion_ids) for e in examples] == expected
