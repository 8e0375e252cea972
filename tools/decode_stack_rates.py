"""Decode tokens/s of each model with a step's layers in one C++ call (DecodeStack) and layer by layer from Python
(KVYARD_DECODE_STACK=0), the same engine switching between them round by round.

usage: python tools/decode_stack_rates.py BATCHES ROUNDS NAME=MODEL [NAME=MODEL ...]
       python tools/decode_stack_rates.py 1,32 5 bf16=smollm2-135m int8=bench-results/quant-s14-smollm2/int8
"""
import os
import sys

from quant_decode_rates import batches_rounds_engines, paired  # this script's folder is on sys.path

from kvyard.bench.quant import decode_rate


def main() -> None:
    batches, rounds, engines = batches_rounds_engines(sys.argv[1:])
    runs = []
    for r in range(rounds):
        run = {}
        for name, llm in engines.items():
            for b in batches:
                for mode in ("stack", "layers"):
                    os.environ["KVYARD_DECODE_STACK"] = "1" if mode == "stack" else "0"  # read at every step
                    run[f"{name}.b{b}.{mode}"] = decode_rate(llm, b, 128, 32)
        runs.append(run)
        print(f"round {r + 1}: " + ", ".join(f"{k}={v:.1f}" for k, v in run.items()), flush=True)
    for name in engines:
        for b in batches:
            print(f"{name} b{b}, the stack against layer by layer: "
                  + paired(runs, f"{name}.b{b}.stack", f"{name}.b{b}.layers"))


if __name__ == "__main__":
    main()
