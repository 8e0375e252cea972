"""Calibration text the model writes itself: half free-running from BOS, half answers to short chat
prompts, sampled at temperature 1 (data-free calibration, for when no corpus is at hand).

usage: python tools/self_calib.py MODEL N OUT.jsonl    (N sequences of up to 256 tokens; feed OUT to
       `kvyard quantize --calib` or to tools/quant_rounding_kl.py as HESS=OUT)
"""
import json
import sys
import time

from kvyard.llm import LLM
from kvyard.sampling_params import SamplingParams

TOPICS = ["history", "cooking", "python code", "physics", "a short story", "travel", "medicine", "music",
          "mathematics", "a JSON config", "gardening", "law", "sports", "economics", "SQL queries", "poetry"]


def main() -> None:
    model, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    llm = LLM(model, dtype="bfloat16")
    tok = llm.tokenizer
    start = [tok.bos_token_id] if tok.bos_token_id is not None else tok("The").input_ids
    prompts = [start if i % 2 == 0 else
               llm.chat_prompt([{"role": "user", "content": f"Write a detailed paragraph about {TOPICS[i % len(TOPICS)]}."}])
               for i in range(n)]
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, top_p=0.95, max_tokens=256, seed=1234))
    with open(out, "w") as f:
        for p, o in zip(prompts, outs, strict=True):
            f.write(json.dumps({"text": tok.decode(p + o.outputs[0].token_ids, skip_special_tokens=False)}) + "\n")
    print(f"{sum(len(o.outputs[0].token_ids) for o in outs)} tokens in {time.perf_counter() - t:.1f}s -> {out}")


if __name__ == "__main__":
    main()
