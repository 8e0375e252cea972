"""What key smoothing (kvyard/quant/kv_smoothing.py) does for the int8 KV cache: KL against the source model
with a dense cache, on the quantization calibration set (the factors are fitted on their own text), for the
int8 cache without and with smoothing, and for the smoothed model with a dense cache (which must be the
source bit for bit: the factors are powers of two).

usage: python tools/kv_smoothing_probe.py MODEL DTYPE      e.g. qwen2.5-coder-0.5b float32
"""
import sys

import torch

from kvyard.models.decoder import DecoderModel
from kvyard.quant.kv_smoothing import key_pair_peaks, smooth_keys
from kvyard.quant.tool import QuantizeOptions, load_reference


def main() -> None:
    torch.set_num_threads(2)
    ref = load_reference(QuantizeOptions(model=sys.argv[1], scheme="int8", dtype=sys.argv[2], progress=False))

    def report(label: str, model: DecoderModel, kv_int8: bool) -> None:
        with torch.inference_mode():
            f = ref.meter.measure(model, kv_int8=kv_int8)
        print(f"{label:28s} KL {f.kl_mean:.2e} (p99 {f.kl_p99:.2e}), top-1 {f.top1_agreement:.3f}", flush=True)

    peaks = key_pair_peaks(ref.model, ref.meter.sequences)
    spread = sorted((p.amax(-1) / p.mean(-1)).max().item() for p in peaks)
    print(f"{len(ref.meter.sequences)} sequences; per layer, the largest key pair peak over its head's mean: "
          f"max {spread[-1]:.1f}, median {spread[len(spread) // 2]:.1f}")
    report("int8 KV", ref.model, True)
    smooth_keys(ref.model, ref.ckpt.tokenizer, ref.opts.max_seq_len)
    report("int8 KV, keys smoothed", ref.model, True)
    report("dense KV, keys smoothed", ref.model, False)


if __name__ == "__main__":
    main()
