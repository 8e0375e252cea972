"""KL of rtn vs gptq rounding (`kvyard quantize --rounding`), on the calibration set (which GPTQ's Hessians also come from) and on held-out text.

usage: python tools/quant_rounding_kl.py MODEL DTYPE [SCHEMES [SCALING]]
       (writes bench-results/quant-rounding/kl_<model>_<dtype><TAG>.json; HESS=FILE takes the Hessians from FILE;
       SCALING is none (default) or awq, applied before either rounding; ROUNDINGS=rtn skips gptq)
"""
import json
import os
import sys
import time

import torch

from kvyard.quant.calib import build_calibration, read_calib_file
from kvyard.quant.fidelity import FidelityMeter
from kvyard.quant.plan import DEFAULT_PROTECT, is_protected, linear_units
from kvyard.quant.qtensor import QuantizedTensor
from kvyard.quant.scheme import parse_weight_scheme
from kvyard.quant.search import UnitSwitch
from kvyard.quant.tool import (
    QuantizeOptions,
    load_reference,
    quantize_members,
    scaled_reference,
    unit_schemes,
)

HELD_OUT = [
    "The river rose slowly through the night, and by morning the lower fields were under water. Farmers "
    "moved their animals to the hills, while the town council met to decide whether to open the old "
    "floodgates downstream, a decision that would save the market square but flood the mill.",
    "import json\n\ndef load_config(path: str) -> dict:\n    with open(path) as f:\n        data = json.load(f)\n"
    "    if 'name' not in data:\n        raise ValueError('config needs a name')\n    return data\n\n"
    "for key, value in load_config('app.json').items():\n    print(f'{key} = {value}')",
    "Volcanoes form where magma reaches the surface, most often at the edges of tectonic plates. Some "
    "erupt explosively, throwing ash high into the atmosphere; others release slow rivers of lava that "
    "cool into black rock and, over centuries, build islands such as Hawaii.",
    "Dear Ms. Alvarez, thank you for your letter of March 3. We have reviewed your account and agree that "
    "the late fee was charged in error. The amount has been refunded and should appear on your next "
    "statement. Please contact us if there is anything else we can help with.",
    "To change a flat tyre, loosen the wheel nuts slightly before lifting the car with the jack. Remove "
    "the nuts and the wheel, fit the spare, tighten the nuts by hand, lower the car, and then tighten "
    "them fully in a star pattern so the wheel sits evenly.",
    "SELECT customer_id, COUNT(*) AS orders, SUM(total) AS revenue\nFROM orders\nWHERE created_at >= "
    "'2024-01-01'\nGROUP BY customer_id\nHAVING COUNT(*) > 3\nORDER BY revenue DESC\nLIMIT 10;",
    "In economics, inflation is the rate at which the general level of prices rises. Central banks try to "
    "keep it low and stable, usually by raising interest rates when prices climb too quickly and lowering "
    "them when the economy slows and unemployment grows.",
    "Q: If a rectangle is 7 cm wide and 12 cm long, what is its area and its perimeter?\nA: The area is "
    "7 * 12 = 84 square centimetres, and the perimeter is 2 * (7 + 12) = 38 centimetres.",
]


def row(f):
    return {"kl_mean": f.kl_mean, "kl_p99": f.kl_p99, "top1": f.top1_agreement, "ppl_change": f.ppl_change,
            "tokens": f.tokens}


def main() -> None:
    torch.set_num_threads(1)  # measured next to other work; KL does not depend on threads
    model_name, dtype = sys.argv[1], sys.argv[2]
    schemes = sys.argv[3].split(",") if len(sys.argv) > 3 else ["int8", "int4-g128"]
    scaling = sys.argv[4] if len(sys.argv) > 4 else "none"
    opts = QuantizeOptions(model=model_name, scheme="int8", dtype=dtype, progress=False)
    t0 = time.perf_counter()
    source = load_reference(opts)
    held = FidelityMeter(source.model, build_calibration(source.ckpt.tokenizer, HELD_OUT, 256).sequences[: len(HELD_OUT)])
    print(f"loaded in {time.perf_counter() - t0:.1f}s; calib tokens {sum(map(len, source.meter.sequences))}, "
          f"held-out tokens {sum(map(len, held.sequences))}", flush=True)
    units = [u for u in linear_units(source.ckpt.config) if not is_protected(u, DEFAULT_PROTECT)]
    hess_file = os.environ.get("HESS")  # Hessians from this text instead of the calibration set
    seqs = source.calib.sequences
    if hess_file:
        seqs = build_calibration(source.ckpt.tokenizer, read_calib_file(hess_file), 256).sequences
    print(f"hessians from {hess_file or 'calib'}: {sum(map(len, seqs))} tokens", flush=True)
    out = {"model": model_name, "dtype": dtype, "scaling": scaling, "hessians": hess_file or "calib", "hessian_tokens":
           sum(map(len, seqs)), "results": []}
    for scheme in schemes:
        ref = source
        if scaling == "awq":  # the scales depend on the scheme; the source stays for the next one
            ref, _ = scaled_reference(source, units, parse_weight_scheme(scheme), opts)
        for rounding in os.environ.get("ROUNDINGS", "rtn,gptq").split(","):
            t = time.perf_counter()
            members = quantize_members(ref, units, unit_schemes(units, parse_weight_scheme(scheme)), rounding, seqs)
            q_s = time.perf_counter() - t
            fused = {u.name: QuantizedTensor.cat([members[m] for m in u.members]) for u in units}
            switch = UnitSwitch(ref.model, fused, units)
            switch.apply({u.name for u in units})
            with torch.inference_mode():
                res = {"scheme": scheme, "rounding": rounding, "scaling": scaling, "quantize_s": q_s,
                       "calib": row(ref.meter.measure(ref.model)), "held_out": row(held.measure(ref.model))}
            switch.apply(set())
            out["results"].append(res)
            print(json.dumps(res), flush=True)
    tag = os.environ.get("TAG", "")
    path = f"bench-results/quant-rounding/kl_{model_name}_{dtype}{tag}.json"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
