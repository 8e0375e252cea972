"""Quantization schemes by name: `int8`, `int4-g128`, `int4-g64-asym`, `int4-g32-min`, and `mixed`."""

import re
from dataclasses import dataclass

from kvyard.errors import ConfigError

INT4_GROUP_SIZES = (32, 64, 128)
SCHEME_HELP = "int8, int4-g32|g64|g128 (add -asym for an integer zero point, -min for a float one), or mixed"
# How weights are rounded to the grid: round to nearest, or GPTQ (kvyard.quant.gptq), which moves each
# column's error onto later columns using the calibration inputs. Round to nearest stays the default: with
# the built-in calibration text (~1.5k tokens), GPTQ's KL on held-out text on SmolLM2-135M and
# Qwen2.5-Coder-0.5B was no better for int4-g128 and only sometimes better for int8, and its KL measured
# on the calibration text itself is in-sample (far lower than on other text).
ROUNDINGS = ("rtn", "gptq")
# `--quantization gguf`: no rounding at all; a GGUF file's blocks load as they are (loader/gguf_native.py).
KEEP_GGUF = "gguf"
DEFAULT_ROUNDING = "rtn"


@dataclass(frozen=True)
class WeightScheme:
    """How one linear layer's weight is stored: int8 per output channel, or int4 per group along K."""

    bits: int
    group_size: int | None = None  # None: one scale per output channel
    symmetric: bool = True
    # Asymmetric with a float zero point: each group's own minimum is its offset, as GGUF's Q4_1 and Q4_K store
    # it, so a weight already on such a grid (a 4-bit GGUF source, same group size) comes back exactly.
    float_zero: bool = False

    @property
    def name(self) -> str:
        if self.bits == 8:
            # grouped int8 (with a float zero point: -min) only comes from GGUF's blocks (loader/gguf_native.py)
            return "int8" if self.group_size is None else f"int8-g{self.group_size}" + ("-min" if self.float_zero else "")
        return f"int4-g{self.group_size}" + ("" if self.symmetric else "-min" if self.float_zero else "-asym")

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1)) + (1 if self.bits == 8 else 0)  # int8 is kept symmetric: -127..127

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1


def check_rounding(rounding: str) -> str:
    if rounding not in ROUNDINGS:
        raise ConfigError(f"unknown rounding {rounding!r}; choose {', '.join(ROUNDINGS)}", param="rounding")
    return rounding


def parse_weight_scheme(name: str) -> WeightScheme:
    """`int8` or `int4-g<32|64|128>[-asym]`; anything else is a ConfigError that lists the choices."""
    if name == "int8":
        return WeightScheme(bits=8)
    m = re.fullmatch(r"int4-g(\d+)(-asym|-sym|-min)?", name)
    if not m:
        raise ConfigError(f"unknown quantization scheme {name!r}; choose {SCHEME_HELP}", param="scheme")
    group = int(m.group(1))
    if group not in INT4_GROUP_SIZES:
        raise ConfigError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group}", param="scheme")
    return WeightScheme(bits=4, group_size=group, symmetric=m.group(2) not in ("-asym", "-min"),
                        float_zero=m.group(2) == "-min")


@dataclass(frozen=True)
class QuantRequest:
    """What `kvyard quantize --scheme` asks for: one scheme everywhere, or a searched mixed plan."""

    scheme: str  # as typed
    weight: WeightScheme  # the low-bit format; for `mixed`, the one chosen layers get
    mixed: bool
    head: WeightScheme | None = None  # the LM head's own format (--head-scheme); None: it follows --protect


def parse_quant_request(scheme: str, mixed_weight: str = "int4-g128", head: str | None = None) -> QuantRequest:
    head_scheme = None if head is None else parse_weight_scheme(head)
    if scheme == "mixed":
        return QuantRequest(scheme, parse_weight_scheme(mixed_weight), mixed=True, head=head_scheme)
    return QuantRequest(scheme, parse_weight_scheme(scheme), mixed=False, head=head_scheme)
