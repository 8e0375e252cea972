"""`kvyard moe split`: a real-weight Mixture-of-Experts model made from a dense llama-family checkpoint.

    kvyard moe split --model smollm2-135m --experts 8 --top-k 2 --out bench-results/smollm2-moe8

A SwiGLU MLP is a sum over its neurons: down[:, n] * silu(gate[n] . x) * (up[n] . x). Cut the neurons into E
equal groups and each group is an expert whose outputs add up to the dense MLP's. The result is written as a
Mixtral checkpoint (llama attention, a top-k router that renormalises over the chosen k), so transformers
reads it too. Each expert's down projection is scaled by k, and the router's logits are kept near zero, so the
k chosen experts get weights of about 1/k each and contribute about what they did in the dense model:
- with every expert active (k = E) the router is all zeros, every weight is exactly 1/E (E a power of two
  keeps the scaling exact), and the model equals the dense one up to the order of the sums;
- with k < E a linear router is fitted, by least squares on the dense model's own activations over a
  calibration text, to predict how much each expert adds to each token's output (the norm of its partial
  sum); a token goes to the k experts predicted to add most. The report gives the KL divergence of the
  next-token distributions from the dense model's, on text the router was not fitted on.
"""

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvyard.errors import KvyardError
from kvyard.loader.checkpoint import load_checkpoint
from kvyard.loader.hf_model import hf_causal_lm
from kvyard.loader.registry import resolve_model
from kvyard.models.derived import divergence, original_texts, save_checkpoint

ROUTER_SPREAD = 1e-3  # the largest router logit; softmax over the chosen k then stays within ~0.1 % of 1/k


def add_moe_parser(sub: argparse._SubParsersAction) -> None:
    moe = sub.add_parser("moe", help="Mixture-of-Experts tools").add_subparsers(dest="moe", required=True)
    p = moe.add_parser("split", help="split a dense llama-family model's MLPs into experts (a Mixtral checkpoint)")
    p.add_argument("--model", default="smollm2-135m", help="a dense llama-family model: a name, directory or GGUF")
    p.add_argument("--experts", type=int, default=8, help="experts per layer; they divide the MLP's neurons")
    p.add_argument("--top-k", type=int, default=None, help="experts per token (default: all, which equals the dense model)")
    p.add_argument("--out", required=True, help="the directory to write the checkpoint and report.json to")
    p.add_argument("--calibration-prompts", type=int, default=48, help="prompts whose continuations fit the router")
    p.add_argument("--eval-prompts", type=int, default=16, help="other prompts whose continuations measure the KL")
    p.set_defaults(func=cmd_moe_split)


def cmd_moe_split(args: argparse.Namespace) -> int:
    report = split_model(args.model, args.experts, args.top_k or args.experts, Path(args.out),
                         args.calibration_prompts, args.eval_prompts)
    print(json.dumps(report, indent=2))
    return 0


def split_model(model: str, experts: int, top_k: int, out: Path, calibration_prompts: int = 48,
                eval_prompts: int = 16) -> dict[str, Any]:
    ckpt = load_checkpoint(resolve_model(model))
    cfg = ckpt.config
    if cfg.model_type not in ("llama", "mistral") or cfg.num_experts:
        raise KvyardError(f"{ckpt.path}: moe split takes a dense llama or mistral model, not {cfg.model_type}")
    if cfg.intermediate_size % experts or not 1 <= top_k <= experts:
        raise KvyardError(f"moe split: {experts} experts must divide the MLP's {cfg.intermediate_size} neurons, "
                          f"and --top-k must be 1 to {experts} (got {top_k})")
    weights = {name: t.float() for name, t in ckpt.tensors()}
    dense = hf_causal_lm(ckpt.hf_config, weights)
    texts = original_texts(ckpt.tokenizer, dense, calibration_prompts + eval_prompts)
    calibration, evaluation = texts[:calibration_prompts], texts[calibration_prompts:]
    routers = _fit_routers(dense, calibration, experts, cfg.intermediate_size // experts) if top_k < experts else None
    moe_weights, moe_config = _moe_checkpoint(ckpt.hf_config, weights, experts, top_k, routers)
    save_checkpoint(out, moe_config, moe_weights, ckpt.tokenizer)
    import transformers

    moe = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()  # as users read it
    report = {"model": str(model), "experts": experts, "top_k": top_k, "out": str(out),
              "calibration_tokens": sum(len(t) for t in calibration), **divergence(dense, moe, evaluation)}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _fit_routers(dense: Any, texts: list[list[int]], experts: int, size: int) -> list[torch.Tensor]:
    """Per layer, a linear map from the MLP's input to each expert's share of its output (least squares)."""
    inputs: dict[int, list[torch.Tensor]] = {}
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, a, i=i: inputs.setdefault(i, []).append(a[0][0]))
             for i, layer in enumerate(dense.model.layers)]
    with torch.no_grad():
        for ids in texts:
            dense(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    routers = []
    for i, layer in enumerate(dense.model.layers):
        x = torch.cat(inputs[i])  # [tokens, hidden]
        mlp = layer.mlp
        act = F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)  # [tokens, inter]
        share = torch.stack([F.linear(act[:, e * size:(e + 1) * size], mlp.down_proj.weight[:, e * size:(e + 1) * size])
                             .norm(dim=-1) for e in range(experts)], dim=1)  # [tokens, experts]
        # No bias column: Mixtral's router has none. The normed hidden state carries its own constant directions.
        router = torch.linalg.lstsq(x, share).solution.T  # [experts, hidden]
        routers.append(router if torch.isfinite(router).all() else torch.zeros_like(router))
    return routers


def _moe_checkpoint(hf_config: dict[str, Any], weights: dict[str, torch.Tensor], experts: int, top_k: int,
                    routers: list[torch.Tensor] | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    layers = int(hf_config["num_hidden_layers"])
    size = int(hf_config["intermediate_size"]) // experts
    out = {k: v for k, v in weights.items() if ".mlp." not in k}
    for i in range(layers):
        p, b = f"model.layers.{i}.mlp.", f"model.layers.{i}.block_sparse_moe."
        gate, up, down = weights[p + "gate_proj.weight"], weights[p + "up_proj.weight"], weights[p + "down_proj.weight"]
        for e in range(experts):
            rows = slice(e * size, (e + 1) * size)
            out[f"{b}experts.{e}.w1.weight"] = gate[rows].clone()
            out[f"{b}experts.{e}.w3.weight"] = up[rows].clone()
            out[f"{b}experts.{e}.w2.weight"] = (down[:, rows] * top_k).contiguous()
        router = torch.zeros(experts, gate.shape[1]) if routers is None else routers[i]
        scale = router.abs().max()
        out[b + "gate.weight"] = router * (ROUTER_SPREAD / scale) if scale > 0 else router
    config = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type", "rope_scaling")}
    config.update(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=experts,
                  num_experts_per_tok=top_k, intermediate_size=size, router_jitter_noise=0.0, sliding_window=None,
                  output_router_logits=False)
    if hf_config.get("rope_scaling"):
        config["rope_scaling"] = hf_config["rope_scaling"]
    return out, config


