"""Read the quantized linear layers of an HF directory written by `kvyard quantize` (compressed-tensors)."""

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kvyard.errors import CheckpointError
from kvyard.models.config import ModelConfig
from kvyard.quant.plan import Plan, linear_units, plan_from_config
from kvyard.quant.qtensor import QuantizedTensor

_PARTS = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
          "weight_outlier_columns", "weight_outliers")  # the last two: kvyard's outlier columns (qtensor.py)


def read_plan(hf_config: dict[str, Any], config: ModelConfig, where: str) -> Plan:
    all_linear = [m for u in linear_units(config) for m in u.members]
    return plan_from_config(hf_config["quantization_config"], all_linear, where)


def quantized_stream(locations: dict[str, Path], dense: set[str], plan: Plan,
                     where: str) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Dense tensors as they are, and each planned layer assembled from its compressed-tensors parts."""
    try:
        with ExitStack() as stack:
            handles = {f: stack.enter_context(safe_open(f, framework="pt")) for f in set(locations.values())}

            def read(name: str) -> torch.Tensor:
                return handles[locations[name]].get_tensor(name)

            for name in sorted(dense):
                yield name, read(name)
            for layer, scheme in plan.items():
                prefix = layer + "."
                parts = {prefix + p: read(prefix + p) for p in _PARTS if prefix + p in locations}
                yield prefix + "weight", QuantizedTensor.from_state_dict(parts, prefix, scheme, where)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{where}: failed while reading tensors ({e})") from e
