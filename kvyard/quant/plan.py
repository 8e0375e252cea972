"""Which linear layers get which scheme: units of quantization, plans, and their place in config.json.

The engine fuses q|k|v and gate|up into one matmul each, so those projections are quantized together:
a unit is what the engine runs as one matmul. A plan maps HF linear names to a WeightScheme and is
stored as a compressed-tensors `quantization_config`.
"""

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvyard.errors import CheckpointError, ConfigError
from kvyard.models.config import ModelConfig
from kvyard.models.moe import expert_tensor_names
from kvyard.quant.qtensor import QuantizedTensor
from kvyard.quant.scheme import KEEP_GGUF, WeightScheme, parse_weight_scheme

if TYPE_CHECKING:
    from kvyard.loader.checkpoint import Checkpoint

Plan = dict[str, WeightScheme]  # HF linear name (without `.weight`) -> scheme
DEFAULT_PROTECT = ("lm_head",)  # the embedding table is never quantized: it is a lookup, not a matmul


@dataclass(frozen=True)
class Unit:
    name: str  # `model.layers.3.mlp.gate_up`, or `lm_head`
    members: tuple[str, ...]  # the HF linear names it fuses
    params: int
    layer: int | None  # None for lm_head
    attr: str  # the DecoderModel / LayerWeights attribute that holds its weight


def linear_units(cfg: ModelConfig) -> list[Unit]:
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    units = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        if cfg.is_mla:
            units += _latent_attention_units(cfg, i)
        else:
            units += [
                Unit(p + "self_attn.qkv", tuple(p + f"self_attn.{x}_proj" for x in "qkv"), h * (q + 2 * kv), i, "qkv"),
                Unit(p + "self_attn.o_proj", (p + "self_attn.o_proj",), q * h, i, "o"),
            ]
        if not cfg.is_sparse(i):  # a Mixture-of-Experts layer has experts instead (expert_units)
            units += [
                Unit(p + "mlp.gate_up", (p + "mlp.gate_proj", p + "mlp.up_proj"), 2 * h * inter, i, "gate_up"),
                Unit(p + "mlp.down_proj", (p + "mlp.down_proj",), inter * h, i, "down"),
            ]
    units.append(Unit("lm_head", ("lm_head",), cfg.vocab_size * h, None, "lm_head"))
    return units


def _latent_attention_units(cfg: ModelConfig, i: int) -> list[Unit]:
    """DeepSeek's attention (kvyard/models/deepseek.py): q (or its low-rank input) fused with the KV latent's
    projection, q's low-rank output, the latent's expansion and o."""
    a = f"model.layers.{i}.self_attn."
    h, heads, rank, rope = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.head_dim
    q_out = cfg.q_lora_rank or heads * (cfg.qk_nope_head_dim + rope)
    units = [Unit(a + "qkv", (a + ("q_a_proj" if cfg.q_lora_rank else "q_proj"), a + "kv_a_proj_with_mqa"),
                  h * (q_out + rank + rope), i, "qkv")]
    if cfg.q_lora_rank:
        units.append(Unit(a + "q_b_proj", (a + "q_b_proj",), q_out * heads * (cfg.qk_nope_head_dim + rope), i, "mla"))
    return units + [
        Unit(a + "kv_b_proj", (a + "kv_b_proj",), rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), i, "mla"),
        Unit(a + "o_proj", (a + "o_proj",), heads * cfg.v_head_dim * h, i, "o"),
    ]


def is_protected(unit: Unit, protect: Iterable[str]) -> bool:
    """`protect` holds substrings or `re:` patterns matched against the unit and its members."""
    names = (unit.name, *unit.members)
    for pat in protect:
        if pat.startswith("re:"):
            if any(re.search(pat[3:], n) for n in names):
                return True
        elif any(pat in n for n in names):
            return True
    return False


def plan_for_units(units: Iterable[Unit], scheme: WeightScheme) -> Plan:
    return {m: scheme for u in units for m in u.members}


def uniform_plan(cfg: ModelConfig, scheme: WeightScheme, protect: Iterable[str] = DEFAULT_PROTECT) -> Plan:
    protect = tuple(protect)
    units = linear_units(cfg) + expert_units(cfg)
    return plan_for_units([u for u in units if not is_protected(u, protect)], scheme)


def expert_units(cfg: ModelConfig) -> list[Unit]:
    """Every expert's gate|up and down in a Mixture-of-Experts model (kvyard/models/moe.py stacks their codes).
    Not the router or the shared expert's gate, which are small and steer every token. The uniform plan covers
    them; the calibrated ones (GPTQ, AWQ), which walk linear_units, do not yet."""
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    units = []
    for i in (i for i in range(cfg.num_layers) if cfg.is_sparse(i)):
        _, experts, _ = expert_tensor_names(cfg, i)
        for e, (gate, up, down) in enumerate(experts):
            name = f"model.layers.{i}.experts.{e}."
            members = [n.removesuffix(".weight") for n in (gate, up, down)]
            units += [Unit(name + "gate_up", tuple(members[:2]), 2 * h * inter, i, "moe"),
                      Unit(name + "down", (members[2],), inter * h, i, "moe")]
    return units


def quantize_stream(
    tensors: Iterable[tuple[str, torch.Tensor]], plan: Plan
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Quantize the planned weights of a checkpoint's tensor stream as they go by."""
    for name, t in tensors:
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and base in plan:
            yield name, QuantizedTensor.quantize(t, plan[base])
        else:
            yield name, t


def served_tensors(ckpt: "Checkpoint", quantization: str | None
                   ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The weights an engine loads with `--quantization`: the checkpoint's own, its GGUF blocks kept (`gguf`),
    or every planned linear rounded to the scheme as it goes by. The engine and `kvyard tune`'s fidelity gate
    both load this way, so what the gate measures is what is served."""
    if not quantization:
        return ckpt.tensors()
    if quantization == KEEP_GGUF:
        if ckpt.native_tensors is None:
            raise ConfigError(f"quantization gguf keeps a GGUF file's blocks; {ckpt.path} is not a GGUF file",
                              param="quantization")
        return ckpt.native_tensors()
    return quantize_stream(ckpt.tensors(), uniform_plan(ckpt.config, parse_weight_scheme(quantization)))


def add_tied_head(tensors: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig,
                  plan: Plan) -> Iterator[tuple[str, torch.Tensor]]:
    """A tied model has no lm_head tensor; when the plan quantizes the head, give it one to quantize."""
    for name, t in tensors:
        yield name, t
        if name == "model.embed_tokens.weight" and cfg.tie_word_embeddings and "lm_head" in plan:
            yield "lm_head.weight", t


# ---- compressed-tensors quantization_config ----------------------------------------------------------


def _scheme_args(s: WeightScheme) -> dict[str, Any]:
    strategy = "channel" if s.group_size is None else "group"
    args = {"num_bits": s.bits, "type": "int", "symmetric": s.symmetric, "strategy": strategy, "group_size": s.group_size}
    return {**args, "zp_dtype": "float32"} if s.float_zero else args


def plan_to_config(plan: Plan, all_linear: Iterable[str]) -> dict[str, Any]:
    by_scheme: dict[WeightScheme, list[str]] = {}
    for name, s in plan.items():
        by_scheme.setdefault(s, []).append(name)
    groups = {
        f"group_{i}": {"targets": sorted(names), "weights": _scheme_args(s)}
        for i, (s, names) in enumerate(sorted(by_scheme.items(), key=lambda kv: kv[0].name))
    }
    formats = {"pack-quantized" if s.bits == 4 else "int-quantized" for s in by_scheme}
    return {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "config_groups": groups,
        "ignore": sorted(set(all_linear) - set(plan)),
    }


def _parse_args(args: dict[str, Any], where: str) -> WeightScheme:
    bits, sym, group = args.get("num_bits"), bool(args.get("symmetric", True)), args.get("group_size")
    if args.get("type", "int") != "int" or bits not in (4, 8):
        raise CheckpointError(f"{where}: unsupported weight quantization {args} (kvyard runs int8 and int4)")
    if bits == 8 and (group is not None or not sym):
        raise CheckpointError(f"{where}: int8 must be symmetric per channel, got {args}")
    if bits == 4 and group is None:
        raise CheckpointError(f"{where}: int4 needs a group_size, got {args}")
    float_zero = args.get("zp_dtype") == "float32"
    if float_zero and sym:
        raise CheckpointError(f"{where}: a float zero point needs symmetric: false, got {args}")
    return WeightScheme(bits=bits, group_size=group, symmetric=sym, float_zero=float_zero)


def plan_from_config(qcfg: dict[str, Any], all_linear: list[str], where: str) -> Plan:
    """Read a compressed-tensors quantization_config: targets are exact names, `re:` patterns or `Linear`."""
    if qcfg.get("quant_method") != "compressed-tensors":
        raise CheckpointError(f"{where}: quantization method {qcfg.get('quant_method')!r} is not supported "
                              "(kvyard reads compressed-tensors int8/int4 weights)")
    ignore = set(qcfg.get("ignore", []))
    plan: Plan = {}
    for gname, group in (qcfg.get("config_groups") or {}).items():
        scheme = _parse_args(group.get("weights") or {}, f"{where} config_groups.{gname}")
        for target in group.get("targets", []):
            if target == "Linear":
                hits = [n for n in all_linear if n not in ignore]
            elif target.startswith("re:"):
                hits = [n for n in all_linear if re.fullmatch(target[3:], n) and n not in ignore]
            else:
                hits = [target] if target in all_linear else []
            if not hits:
                raise CheckpointError(f"{where}: config_groups.{gname} target {target!r} matches no linear layer")
            plan.update(dict.fromkeys(hits, scheme))
    return plan

