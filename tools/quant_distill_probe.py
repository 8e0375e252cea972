"""Can distillation rescue int4-g128? Latent weights and per-group scales tuned QAT-style (straight-through
rounding) to minimise KL(source || quantized) on text the model wrote itself (tools/self_calib.py), float32, HF
transformers for the gradients; measured like the other probes, on the calibration set and on the held-out passages.

usage: python tools/quant_distill_probe.py MODEL SELFGEN.jsonl STEPS [FRACTION] [LR]
       python tools/self_calib.py smollm2-135m 96 selfgen.jsonl
       python tools/quant_distill_probe.py smollm2-135m selfgen.jsonl 90 0.0 1e-5
FRACTION: outlier columns kept (as kvyard quantize --outlier-columns); LR: Adam's for the weights (scales 10x).
Two sequences of up to 256 tokens a step; prints the KL before tuning and at a third, two thirds and the end.
"""
import json
import sys
import time

import torch
import torch.nn.functional as F
import transformers
from quant_noise_probe import measure, reference_and_held_out  # this script's folder is on sys.path

from kvyard.quant.calib import build_calibration
from kvyard.quant.plan import DEFAULT_PROTECT, is_protected, linear_units
from kvyard.quant.qtensor import QuantizedTensor
from kvyard.quant.scheme import parse_weight_scheme
from kvyard.quant.tool import outlier_columns

model_name, selfgen, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
fraction = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
lr = float(sys.argv[5]) if len(sys.argv) > 5 else 1e-5
scheme = parse_weight_scheme("int4-g128")
G = 128

ref, held = reference_and_held_out(model_name, "float32")
torch.set_num_threads(2)
units = [u for u in linear_units(ref.ckpt.config) if not is_protected(u, DEFAULT_PROTECT)]
keep = outlier_columns(ref, units, fraction)
members = {m: keep.get(u.name) for u in units for m in u.members}

hf_cfg = transformers.AutoConfig.for_model(**{k: v for k, v in ref.ckpt.hf_config.items() if k != "quantization_config"})


def build() -> torch.nn.Module:
    m = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    _, unexpected = m.load_state_dict({k: v.float() for k, v in ref.tensors.items()}, strict=False)
    assert not unexpected, unexpected
    m.tie_weights()
    return m.eval()


teacher, student = build(), build()
for param in [*teacher.parameters(), *student.parameters()]:
    param.requires_grad_(False)


class FakeQuant(torch.nn.Module):
    """A linear layer whose weight is rounded to int4-g128 on the way in (outlier columns left as they are)."""

    def __init__(self, lin: torch.nn.Linear, cols: torch.Tensor | None):
        super().__init__()
        w = lin.weight.detach().clone()
        n, k = w.shape
        self.n, self.k = n, k
        mask = torch.ones(k)
        if cols is not None and cols.numel():
            mask[cols] = 0
        self.register_buffer("mask", mask)
        qt = QuantizedTensor.quantize(w, scheme, cols)
        self.w = torch.nn.Parameter(w)
        self.log_s = torch.nn.Parameter(qt.scale.float().clamp_min(1e-8).log())  # [n, groups]
        self.bias = lin.bias

    def quantized(self) -> torch.Tensor:
        s = self.log_s.exp().repeat_interleave(G, dim=1)[:, : self.k]
        x = self.w / s
        q = torch.clamp(x + (torch.round(x) - x).detach(), scheme.qmin, scheme.qmax)
        return q * s * self.mask + self.w * (1 - self.mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.quantized(), self.bias)

    def export(self) -> torch.Tensor:
        with torch.no_grad():
            return self.quantized().detach().clone()


fq = {}
for name, mod in list(student.named_modules()):
    for child_name, child in list(mod.named_children()):
        full = f"{name}.{child_name}" if name else child_name
        if full in members:
            fq[full] = FakeQuant(child, members[full])
            setattr(mod, child_name, fq[full])
print(f"{len(fq)} layers fake-quantized", flush=True)

texts = [json.loads(line)["text"] for line in open(selfgen)]
train = build_calibration(ref.ckpt.tokenizer, texts, 256).sequences
train = [s for s in train if len(s) >= 32]
print(f"{len(train)} training sequences, {sum(map(len, train))} tokens", flush=True)


def evaluate(label: str) -> None:
    tensors = dict(ref.tensors)
    for name, m in fq.items():
        tensors[name + ".weight"] = m.export()
    measure(ref, held, tensors, label)


evaluate(f"RTN (step 0), outliers {fraction}:")
params_w = [m.w for m in fq.values()]
params_s = [m.log_s for m in fq.values()]
for param in params_w + params_s:
    param.requires_grad_(True)
opt = torch.optim.Adam([{"params": params_w, "lr": lr}, {"params": params_s, "lr": lr * 10}])
B = 2
gen = torch.Generator().manual_seed(0)
t0 = time.perf_counter()
student.train(False)
for step in range(1, steps + 1):
    idx = torch.randint(len(train), (B,), generator=gen).tolist()
    batch = [train[i] for i in idx]
    L = min(len(s) for s in batch)
    ids = torch.tensor([s[:L] for s in batch])
    with torch.no_grad():
        pt = F.log_softmax(teacher(ids).logits.float(), -1)
    ps = F.log_softmax(student(ids).logits.float(), -1)
    loss = (pt.exp() * (pt - ps)).sum(-1).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 10 == 0:
        print(f"step {step} loss {loss.item():.4f} ({time.perf_counter() - t0:.0f}s)", flush=True)
    if step % max(1, steps // 3) == 0 or step == steps:
        evaluate(f"KD step {step}:")
