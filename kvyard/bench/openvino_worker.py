"""OpenVINO GenAI as a peer process of `kvyard bench offline`: JSON lines in, JSON lines out.

It runs under `make openvino-peer`'s .peers-openvino venv, which has no kvyard, so it imports nothing from
kvyard. usage: python openvino_worker.py MODEL_DIR THREADS MAX_NUM_BATCHED_TOKENS KV_CACHE_GB [KV_PRECISION]
KV_PRECISION (u8, bf16, f16, f32) sets the CPU plugin's KV_CACHE_PRECISION. Without it this pipeline keeps its
cache in the inference precision (bf16 on Zen 4: the same greedy tokens as bf16 asked for, where u8 differs),
although the plugin's own property reads u8.

The model runs in OpenVINO's continuous-batching pipeline (paged attention, split-fuse prefill), with kvyard's
batch token budget and KV cache size, on token ids, so both engines see the same prompts token for token.

Each request line is {"op": "batch" | "batch1", "prompts": [[token ids]], "output_lens": [n]}:
- "batch" submits every prompt at once and answers {"tokens", "seconds", "token_ids": [[generated ids]]};
- "batch1" runs the prompts one at a time, a step per token, and answers {"tokens", "seconds", "itls"}.
The first line out is {"ready": true, "inference_precision": ...} once the model is compiled; an error ends
the process with {"error": "..."}.
"""

import json
import sys
import time


def _greedy(ov_genai, n: int):
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = n
    config.min_new_tokens = n  # EOS ignored, as in kvyard's runs
    config.ignore_eos = True
    config.do_sample = False
    return config


def _tensor(ids: list[int]):
    import numpy as np
    import openvino as ov

    return ov.Tensor(np.array([ids], dtype=np.int64))


def batch(pipe, ov_genai, prompts: list[list[int]], output_lens: list[int]) -> dict:
    inputs = [_tensor(p) for p in prompts]
    configs = [_greedy(ov_genai, n) for n in output_lens]
    start = time.perf_counter()
    results = pipe.generate(inputs, configs)
    seconds = time.perf_counter() - start
    token_ids = [list(r.m_generation_ids[0]) for r in results]
    return {"tokens": sum(len(t) for t in token_ids), "seconds": seconds, "token_ids": token_ids}


def batch1(pipe, ov_genai, prompts: list[list[int]], output_lens: list[int]) -> dict:
    """One request at a time, stepping the pipeline by hand: each step of a lone decoding request makes one
    token, so the gaps between the steps that made tokens are its inter-token latencies."""
    itls: list[float] = []
    tokens = 0
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(prompts, output_lens, strict=True)):
        handle = pipe.add_request(i, _tensor(prompt), _greedy(ov_genai, n))
        last = None
        made = 0
        while pipe.has_non_finished_requests():
            pipe.step()
            outputs = handle.read() if handle.can_read() else {}
            new = sum(len(o.generated_ids) for o in outputs.values())
            if new:
                now = time.perf_counter()
                if last is not None:
                    itls.append(now - last)
                last = now
                made += new
        tokens += made
    return {"tokens": tokens, "seconds": time.perf_counter() - start, "itls": itls}


def main() -> None:
    try:
        import openvino as ov
        import openvino_genai as ov_genai

        model_dir, threads, budget, cache_gb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
        scheduler = ov_genai.SchedulerConfig()
        scheduler.max_num_batched_tokens = budget
        scheduler.cache_size = cache_gb
        scheduler.enable_prefix_caching = False  # every round's prompts are fresh, as for kvyard
        scheduler.dynamic_split_fuse = True
        properties = {"INFERENCE_NUM_THREADS": threads}
        if len(sys.argv) > 5:
            properties["KV_CACHE_PRECISION"] = sys.argv[5]
        pipe = ov_genai.ContinuousBatchingPipeline(model_dir, scheduler, "CPU", properties)
        precision = ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()
        print(json.dumps({"ready": True, "inference_precision": precision}), flush=True)
        ops = {"batch": batch, "batch1": batch1}
        for line in sys.stdin:
            job = json.loads(line)
            print(json.dumps(ops[job["op"]](pipe, ov_genai, job["prompts"], job["output_lens"])), flush=True)
    except Exception as e:  # reported to the parent, which raises it
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
