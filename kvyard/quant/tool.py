"""`kvyard quantize`: quantize a checkpoint, measure its fidelity, and write a directory kvyard serves."""

import json
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from kvyard.config import parse_dtype
from kvyard.errors import ConfigError
from kvyard.loader.checkpoint import Checkpoint, TensorStream, load_checkpoint
from kvyard.loader.registry import resolve_model
from kvyard.models.build import build_model
from kvyard.models.config import ModelConfig
from kvyard.models.decoder import DecoderModel
from kvyard.quant.awq import DEFAULT_SCALING, SCALINGS, UnitScaling, scale_units
from kvyard.quant.calib import (
    DEFAULT_TEXT,
    TOOL_CALL_OPENING,
    Calibration,
    build_calibration,
    read_calib_file,
    valid_tool_call,
)
from kvyard.quant.fidelity import Fidelity, FidelityMeter
from kvyard.quant.gptq import gptq_quantize
from kvyard.quant.hessian import collect_hessians
from kvyard.quant.kv_smoothing import smooth_keys
from kvyard.quant.plan import (
    DEFAULT_PROTECT,
    Plan,
    Unit,
    is_protected,
    linear_units,
    plan_to_config,
    served_tensors,
)
from kvyard.quant.qtensor import QuantizedTensor
from kvyard.quant.scheme import (
    DEFAULT_ROUNDING,
    QuantRequest,
    WeightScheme,
    check_rounding,
    parse_quant_request,
)
from kvyard.quant.search import PlanSearch, SearchResult, UnitSwitch, naive_order, searched_plan
from kvyard.quant.sequential import sequential_gptq


@dataclass
class QuantizeOptions:
    model: str
    scheme: str
    out: Path | None = None
    calib: str | None = None
    kl_budget: float | None = None
    protect: tuple[str, ...] = DEFAULT_PROTECT
    mixed_weight: str = "int4-g128"  # the low-bit format `mixed` gives the layers it picks
    dtype: str = "bfloat16"  # compute dtype of both models while measuring
    max_seq_len: int = 256
    sensitivity: bool = True  # per-layer sensitivity (always on for `mixed`)
    tool_eval: bool = True  # generate tool calls with both models and count valid JSON
    progress: bool = True
    rounding: str = DEFAULT_ROUNDING  # rtn, or gptq with Hessians from the calibration set
    scaling: str = DEFAULT_SCALING  # awq, none, or auto: whichever measures better (kvyard.quant.awq)
    outlier_columns: float = 0.0  # share of each layer's input columns kept in full precision (LLM.int8-style)
    head_scheme: str | None = None  # the LM head's own format (e.g. int8 beside int4 layers); None: as --protect says


@dataclass
class QuantizeResult:
    request: QuantRequest
    plan: Plan
    units: list[Unit]
    chosen: list[str]
    fidelity: Fidelity
    sensitivity: dict[str, Fidelity] = field(default_factory=dict)
    naive: SearchResult | None = None
    searched: SearchResult | None = None
    tool_json: dict[str, float] = field(default_factory=dict)
    out: Path | None = None
    dtype: str = "bfloat16"
    rounding: str = "rtn"
    scaling: dict[str, UnitScaling] = field(default_factory=dict)  # per unit, when scaled
    scaling_trial: dict[str, float] = field(default_factory=dict)  # --scaling auto: KL with and without
    outlier_columns: float = 0.0

    @property
    def quantized_params(self) -> int:
        names = set(self.chosen)
        return sum(u.params for u in self.units if u.name in names)


def check_options(opts: QuantizeOptions) -> QuantRequest:
    req = parse_quant_request(opts.scheme, opts.mixed_weight, opts.head_scheme)
    check_rounding(opts.rounding)
    if opts.scaling not in SCALINGS:
        raise ConfigError(f"unknown scaling {opts.scaling!r}; choose {', '.join(SCALINGS)}", param="scaling")
    if req.mixed and opts.kl_budget is None:
        raise ConfigError("--scheme mixed needs --kl-budget (the largest mean KL the plan may reach)", param="kl_budget")
    if opts.kl_budget is not None and not opts.kl_budget > 0:
        raise ConfigError(f"--kl-budget must be a positive number, got {opts.kl_budget}", param="kl_budget")
    if not 0 <= opts.outlier_columns < 0.5:
        raise ConfigError(f"--outlier-columns is a share of each layer's input columns, from 0 to below 0.5; got "
                          f"{opts.outlier_columns}", param="outlier_columns")
    if opts.outlier_columns and opts.rounding == "gptq":
        raise ConfigError("--outlier-columns works with round to nearest only (--rounding rtn)", param="outlier_columns")
    return req


def candidate_units(cfg: ModelConfig, opts: QuantizeOptions) -> list[Unit]:
    """The units to quantize: all but the protected ones, and the LM head whenever it has a format of its own."""
    return [u for u in linear_units(cfg)
            if not is_protected(u, opts.protect) or (u.attr == "lm_head" and opts.head_scheme is not None)]


def unit_schemes(units: list[Unit], weight: WeightScheme, head: WeightScheme | None = None) -> dict[str, WeightScheme]:
    """Unit name -> format: `weight` everywhere, except the LM head when it has its own (`head`). llama.cpp's
    4-bit files keep the output tensor at 6 bits for the same reason: every token's logits go through it."""
    return {u.name: head if u.attr == "lm_head" and head is not None else weight for u in units}


def _source_weight(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name == "lm_head" and "lm_head.weight" not in tensors:
        return tensors["model.embed_tokens.weight"]  # a tied model's head is its embedding table
    return tensors[name + ".weight"]


@dataclass
class Reference:
    """The unquantized model, its tensors and the calibration set it is measured on."""

    ckpt: Checkpoint
    tensors: dict[str, torch.Tensor]
    calib: Calibration
    model: DecoderModel
    meter: FidelityMeter
    opts: QuantizeOptions  # dtype and sequence length of every model built against it


def load_reference(opts: QuantizeOptions) -> Reference:
    ckpt = load_checkpoint(resolve_model(opts.model))
    tensors = dict(ckpt.tensors())  # float32, as the checkpoint gives them
    texts = read_calib_file(opts.calib) if opts.calib else DEFAULT_TEXT
    calib = build_calibration(ckpt.tokenizer, texts, opts.max_seq_len)
    model = _dense_model(ckpt, tensors, opts)
    return Reference(ckpt, tensors, calib, model, FidelityMeter(model, calib.sequences), opts)


def _dense_model(ckpt: Checkpoint, tensors: dict[str, torch.Tensor] | TensorStream,
                 opts: QuantizeOptions, dynamic_quant: bool = False) -> DecoderModel:
    """`tensors`: a dict, or a checkpoint's stream (read as the model loads, never all at once in float32).
    `dynamic_quant`: low-bit weights meet int8-rounded activations, as an engine with --dynamic-quant runs them."""
    model = build_model(ckpt.config, parse_dtype(opts.dtype), torch.device("cpu"), max_positions=opts.max_seq_len + 1)
    model.dynamic_quant = dynamic_quant
    model.load(tensors.items() if isinstance(tensors, dict) else tensors(), str(ckpt.path))
    return model


def scaled_reference(ref: Reference, units: list[Unit], scheme: WeightScheme, opts: QuantizeOptions,
                     sequences: list[list[int]] | None = None) -> tuple[Reference, dict[str, UnitScaling]]:
    """`ref` with every unit scaled and folded (kvyard.quant.awq), the scales fitted on `sequences` (default:
    the calibration set): its tensors and dense model compute what the source does, and its meter still
    compares against the source itself."""
    with torch.inference_mode():
        hessians = collect_hessians(ref.model, units, ref.calib.sequences if sequences is None else sequences)

    def bar(items: list[Unit]) -> list[Unit]:
        return tqdm(items, desc="awq scales", unit="layer", disable=not opts.progress, leave=False)  # type: ignore[return-value]

    tensors, chosen = scale_units(ref.tensors, ref.ckpt.config, units, hessians, scheme, bar)
    return replace(ref, tensors=tensors, model=_dense_model(ref.ckpt, tensors, opts)), chosen


def _uniform_kl(ref: Reference, units: list[Unit], schemes: dict[str, WeightScheme], meter: FidelityMeter) -> float:
    """Mean KL with every unit rounded to nearest (with its outlier columns): what `--scaling auto` compares."""
    members = quantize_members(ref, units, schemes, "rtn", outliers=outlier_columns(ref, units, ref.opts.outlier_columns))
    switch = UnitSwitch(ref.model, {u.name: QuantizedTensor.cat([members[m] for m in u.members]) for u in units}, units)
    try:
        return PlanSearch(switch, meter, float("inf"), progress=False).measure({u.name for u in units}).kl_mean
    finally:
        switch.apply(set())  # the dense weights back, for the search that follows


def choose_scaling(ref: Reference, units: list[Unit], schemes: dict[str, WeightScheme], scheme: WeightScheme,
                   opts: QuantizeOptions) -> tuple[Reference, dict[str, UnitScaling], dict[str, float]]:
    """The reference to quantize from, its per-unit scales, and (for `auto`) the KL each choice measured. The
    scales are fitted for `scheme`, the decoder layers' format; `schemes` holds every unit's, the head's included.

    `auto` fits the scales on every other calibration sequence and compares both choices on the rest, so
    the decision is made on text the scales did not see (judged on the text they were fitted on, AWQ won
    on Qwen2.5-Coder-0.5B int8 although held-out text measured it worse); the kept scales are then
    fitted on the whole set."""
    trial: dict[str, float] = {}
    if opts.scaling == "none":
        return ref, {}, trial
    if opts.scaling == "auto":
        seqs = ref.calib.sequences
        fit, judge = (seqs[0::2], seqs[1::2]) if len(seqs) >= 2 else (seqs, seqs)
        with torch.inference_mode():
            meter = FidelityMeter(ref.model, judge)
        trial = {"none": _uniform_kl(ref, units, schemes, meter),
                 "awq": _uniform_kl(scaled_reference(ref, units, scheme, opts, fit)[0], units, schemes, meter)}
        if trial["awq"] >= trial["none"]:
            return ref, {}, trial
    scaled, chosen = scaled_reference(ref, units, scheme, opts)
    return scaled, chosen, trial


def outlier_columns(ref: Reference, units: list[Unit], fraction: float) -> dict[str, torch.Tensor]:
    """Per unit, the `fraction` of its input columns whose activations are largest (RMS over the calibration set,
    in `ref`'s model): kept in full precision, as LLM.int8() keeps outlier features. Rounding error on a column
    moves the output in proportion to its input, and these few columns carry most of it; left out of the
    rounding, they also stop setting the scale of every other column in their rows."""
    if fraction <= 0:
        return {}
    with torch.inference_mode():
        hessians = collect_hessians(ref.model, units, ref.calib.sequences)
    keep = {}
    for u in units:
        energy = hessians.pop(u.name).diagonal()
        keep[u.name] = energy.topk(max(1, round(fraction * energy.numel()))).indices.sort().values
    return keep


def quantize_members(ref: Reference, units: list[Unit], schemes: dict[str, WeightScheme], rounding: str,
                     sequences: list[list[int]] | None = None,
                     outliers: dict[str, torch.Tensor] | None = None) -> dict[str, QuantizedTensor]:
    """Every HF linear of `units`, quantized once in its unit's format (`schemes`, by unit name). GPTQ runs
    layer by layer over `sequences` (default: the calibration set), and each fused member gets its unit's
    Hessian. `outliers`: per unit, input columns kept in full precision (round to nearest only)."""
    if rounding == "rtn":
        keep = outliers or {}
        return {m: QuantizedTensor.quantize(_source_weight(ref.tensors, m), schemes[u.name], keep.get(u.name))
                for u in units for m in u.members}

    def quantize_unit(u: Unit, hessian: torch.Tensor) -> dict[str, QuantizedTensor]:
        # GPTQ treats rows independently, so fused members are quantized as one matrix (one factorization).
        parts = [_source_weight(ref.tensors, m) for m in u.members]
        fused = gptq_quantize(torch.cat(parts), hessian, schemes[u.name])
        bounds = torch.tensor([0] + [p.shape[0] for p in parts]).cumsum(0).tolist()
        return {m: fused.rows(a, b) for m, a, b in zip(u.members, bounds, bounds[1:], strict=False)}

    return sequential_gptq(ref.model, units, ref.calib.sequences if sequences is None else sequences, quantize_unit)


def saved_fidelity(ref: Reference, quantized: str | Path, dynamic_quant: bool = False,
                   dtype: str | None = None) -> Fidelity:
    """Measure a saved quantized directory from scratch against `ref` (its source, from load_reference), in
    ref's dtype. In float32 this is the weights' rounding alone; in bfloat16 each side also rounds its
    activations, and two different kernels round differently, which adds KL no weight format can remove."""
    ckpt = load_checkpoint(resolve_model(str(quantized)))
    model = _dense_model(ckpt, ckpt.tensors, replace(ref.opts, dtype=dtype or ref.opts.dtype), dynamic_quant)
    with torch.inference_mode():
        return ref.meter.measure(model)


def source_fidelity(ref: Reference, dtype: str, keep_blocks: bool) -> Fidelity:
    """`ref`'s source itself computed in `dtype` against `ref` (float32 for the file's own weights), with a GGUF
    file's blocks kept (`--quantization gguf`) or dequantized as a plain load does. In float32 with the blocks
    kept this measures that they are read exactly; in bf16 it is what each way of serving the file loses."""
    if keep_blocks and ref.ckpt.native_tensors is None:
        raise ConfigError(f"{ref.ckpt.path} is not a GGUF file: it has no blocks of its own to keep", param="scheme")
    stream = ref.ckpt.native_tensors if keep_blocks else ref.ckpt.tensors
    model = _dense_model(ref.ckpt, stream, replace(ref.opts, dtype=dtype))  # type: ignore[arg-type]
    with torch.inference_mode():
        return ref.meter.measure(model)


def kv_cache_fidelity(ref: Reference) -> Fidelity:
    """The int8 KV cache alone (dense weights), measured like a weight scheme, with the key smoothing an engine
    with an int8 cache applies (fitted on its own text, not on the calibration set measured here). The
    smoothing is exact with a dense cache, so it leaves the reference's other measurements as they were."""
    smooth_keys(ref.model, ref.ckpt.tokenizer, ref.opts.max_seq_len)
    with torch.inference_mode():
        return ref.meter.measure(ref.model, kv_int8=True)


def served_fidelity(ref: Reference, dtype: str, quantization: str | None, kv_int8: bool,
                    dynamic_quant: bool = False) -> Fidelity:
    """The model as an engine serves it (`dtype`, `--quantization`, `--kv-cache-dtype int8`, `--dynamic-quant`: its
    weights loaded as kvyard.quant.plan.served_tensors loads them, its keys smoothed as the engine smooths them)
    against `ref`: what `kvyard tune`'s fidelity gate holds each candidate that changes numerics to."""
    model = _dense_model(ref.ckpt, lambda: served_tensors(ref.ckpt, quantization),  # type: ignore[arg-type]
                         replace(ref.opts, dtype=dtype), dynamic_quant)
    if kv_int8:
        smooth_keys(model, ref.ckpt.tokenizer, ref.opts.max_seq_len)
    with torch.inference_mode():
        return ref.meter.measure(model, kv_int8=kv_int8)


def quantize_model(opts: QuantizeOptions) -> QuantizeResult:
    req = check_options(opts)
    source = load_reference(opts)
    units = candidate_units(source.ckpt.config, opts)
    schemes = unit_schemes(units, req.weight, req.head)
    ref, scaling, trial = choose_scaling(source, units, schemes, req.weight, opts)
    ckpt, tensors, calib, model, meter = ref.ckpt, ref.tensors, ref.calib, ref.model, ref.meter
    # Each HF linear is quantized once: the search runs the fused units, the checkpoint stores the members.
    members = quantize_members(ref, units, schemes, opts.rounding,
                               outliers=outlier_columns(ref, units, opts.outlier_columns))
    quantized = {u.name: QuantizedTensor.cat([members[m] for m in u.members]) for u in units}
    search = PlanSearch(UnitSwitch(model, quantized, units), meter, opts.kl_budget or float("inf"), opts.progress)
    result = QuantizeResult(req, {}, units, [], fidelity=None,  # type: ignore[arg-type]
                            dtype=opts.dtype, rounding=opts.rounding, scaling=scaling,
                            scaling_trial=trial, outlier_columns=opts.outlier_columns)
    if opts.sensitivity or req.mixed:
        result.sensitivity = search.sensitivities()
    if req.mixed:
        result.naive = search.greedy(naive_order(result.sensitivity), stop_at_first_miss=True, desc="naive plan")
        result.searched = searched_plan(search, result.sensitivity, result.naive)
        result.chosen = result.searched.chosen
    else:
        result.chosen = [u.name for u in units]
    result.fidelity = search.measure(set(result.chosen))
    result.plan = {m: schemes[u.name] for u in units if u.name in set(result.chosen) for m in u.members}
    if opts.out is not None:
        result.out = save_quantized(ckpt, tensors, members, result, opts.out)
        if opts.tool_eval:
            result.tool_json = tool_call_validity(ckpt.path, result.out, calib.tool_prompts)
    return result


def save_quantized(ckpt: Checkpoint, tensors: dict[str, torch.Tensor], members: dict[str, QuantizedTensor],
                   result: QuantizeResult, out: Path) -> Path:
    """safetensors + config.json (compressed-tensors quantization_config) + tokenizer + the plan."""
    out.mkdir(parents=True, exist_ok=True)
    state: dict[str, torch.Tensor] = {}
    dense_dtype = parse_dtype(result.dtype)  # the dtype fidelity was measured in
    for name, t in tensors.items():
        if name.removesuffix(".weight") not in result.plan:
            state[name] = t.to(dense_dtype).contiguous()
    for layer in result.plan:
        state.update(members[layer].to_state_dict(layer + "."))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    all_linear = [m for u in linear_units(ckpt.config) for m in u.members]
    qcfg = plan_to_config(result.plan, all_linear)
    if result.outlier_columns:
        # kvyard's own extension (weight_outlier_columns / weight_outliers beside the codes): said here, so that a
        # reader of the config sees a loader that knows only compressed-tensors would drop those columns
        qcfg["kvyard_outlier_columns"] = result.outlier_columns
    config = {**ckpt.hf_config, "torch_dtype": str(dense_dtype).removeprefix("torch."), "quantization_config": qcfg}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    ckpt.tokenizer.save_pretrained(str(out))
    (out / "quant_plan.json").write_text(json.dumps(plan_record(result), indent=2))
    src_gen = Path(ckpt.path) / "generation_config.json"
    if src_gen.is_file():
        shutil.copy(src_gen, out / "generation_config.json")
    return out


def plan_record(result: QuantizeResult) -> dict[str, Any]:
    """The per-layer plan stored with the checkpoint: scheme, size and sensitivity of every unit."""
    chosen = set(result.chosen)
    return {
        "scheme": result.request.scheme,
        "weight_format": result.request.weight.name,
        "head_format": result.request.head.name if result.request.head else None,
        "rounding": result.rounding,
        "scaling": "awq" if result.scaling else "none",
        "scaling_trial_kl": result.scaling_trial or None,
        "outlier_columns": result.outlier_columns,
        "units": [
            {"unit": u.name, "params": u.params, "quantized": u.name in chosen,
             "awq_alpha": result.scaling[u.name].alpha if u.name in result.scaling else None,
             "sensitivity_kl": result.sensitivity[u.name].kl_mean if u.name in result.sensitivity else None}
            for u in result.units
        ],
        "joint": result.fidelity.as_dict(),
    }


def tool_call_validity(full: Path, quant: Path, prompts: list[str], max_tokens: int = 64) -> dict[str, float]:
    """Share of greedy generations that contain a well-formed tool call, for both models."""
    from kvyard.config import EngineConfig
    from kvyard.llm import LLM
    from kvyard.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    rates = {}
    for label, path in (("full", full), ("quant", quant)):
        llm = LLM(config=EngineConfig(model=str(path), kv_cache_memory="64MiB"))
        outs = llm.generate(prompts, params)
        rates[label] = sum(valid_tool_call(TOOL_CALL_OPENING + o.outputs[0].text) for o in outs) / len(prompts)
    return rates
