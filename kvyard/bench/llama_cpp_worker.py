"""llama.cpp (llama-cpp-python) as a peer process of `kvyard bench offline`: JSON lines in, JSON lines out.

It runs under whichever Python has `llama_cpp` (usually `make peers`'s .peers-venv, which has no kvyard), so it
imports nothing from kvyard. usage: python llama_cpp_worker.py GGUF THREADS

Each request line is {"prompts": [[token ids]], "output_lens": [n]}; prompts are generated one at a time, greedy,
each until its n tokens, and the answer line is {"tokens": total, "seconds": wall time, "itls": [gaps in s]}.
The first line out is {"ready": true} once the model is loaded; an error ends the process with {"error": "..."}.
"""

import json
import sys
import time


def generate(llm, prompts: list[list[int]], output_lens: list[int]) -> dict:
    itls: list[float] = []
    tokens = 0
    start = time.perf_counter()
    for prompt, n_out in zip(prompts, output_lens, strict=True):
        last = None
        n = 0
        for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            now = time.perf_counter()
            if last is not None:
                itls.append(now - last)
            last = now
            n += 1
            if n >= n_out:
                break
        tokens += n
    return {"tokens": tokens, "seconds": time.perf_counter() - start, "itls": itls}


def main() -> None:
    try:
        from llama_cpp import Llama

        llm = Llama(model_path=sys.argv[1], n_ctx=2048, n_threads=int(sys.argv[2]), n_batch=512, verbose=False)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            job = json.loads(line)
            print(json.dumps(generate(llm, job["prompts"], job["output_lens"])), flush=True)
    except Exception as e:  # reported to the parent, which raises it
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
