"""The real default model with an adapter on every projection: fp32 tokens and logits equal HF PEFT's merged
model (SmolLM2-135M from its GGUF file, dequantized the same way on both sides)."""

import peft
import torch
import transformers

from kvyard import LLM, SamplingParams
from tests.conftest import assert_greedy_matches

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_smollm2_with_an_adapter_equals_peft_merged(smollm2_path, tmp_path):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32)
    config = peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False,
                             rank_pattern={"down_proj": 8})
    model = peft.get_peft_model(hf, config)
    with torch.no_grad():  # a delta the size of a fine-tune's, so that it changes what is generated
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    model.save_pretrained(tmp_path / "adapter")
    reference = model.merge_and_unload().eval()

    llm = LLM(str(smollm2_path), dtype="float32", lora_adapters={"tuned": str(tmp_path / "adapter")})
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for text in ("The capital of France is", "def fibonacci(n):"):
        prompt = llm.tokenizer(text).input_ids
        tokens = llm.generate([prompt], greedy, lora="tuned")[0].outputs[0].token_ids
        assert_greedy_matches(reference, prompt, tokens, tie=1e-4)
        assert tokens != llm.generate([prompt], greedy)[0].outputs[0].token_ids  # the adapter changes them
        with torch.no_grad():
            theirs = reference(torch.tensor([prompt])).logits[0, -1]
        assert (llm.engine.compute_logits(prompt, lora="tuned") - theirs).abs().max().item() <= 1e-3
