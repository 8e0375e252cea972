"""A quantized weight in its portable form: integer values, scales and zero points, per row or per group.

This is the form kvyard quantizes into, fuses (q|k|v, gate|up) and saves. The layout on disk follows
compressed-tensors: int8 weights are stored as `weight` (int8) with `weight_scale` [N, 1]; int4 weights
as `weight_packed` (eight 4-bit values per int32 along K, offset by 8), `weight_scale` [N, groups],
`weight_zero_point` [N, groups] when asymmetric (float32 for `-min` schemes, int8 otherwise), and
`weight_shape`. Kernel-ready forms are built from it by kvyard.quant.qlinear.

Outlier columns (`kvyard quantize --outlier-columns`, as LLM.int8() keeps outlier features in 16 bits): a
few input columns, those whose activations are largest, can be kept in full precision beside the codes,
which are zero there. kvyard stores them as `weight_outlier_columns` (int64 [C]) and `weight_outliers`
(float32 [N, C]), an extension compressed-tensors does not define.
"""

from dataclasses import dataclass

import torch

from kvyard.errors import CheckpointError, ConfigError
from kvyard.quant.scheme import WeightScheme


@dataclass
class QuantizedTensor:
    scheme: WeightScheme
    q: torch.Tensor  # int8 [N, K], values in [scheme.qmin, scheme.qmax]
    scale: torch.Tensor  # float32 [N, groups]; groups = 1 per channel, else ceil(K / group_size)
    zero_point: torch.Tensor | None = None  # [N, groups], asymmetric only: w = (q - zp) * scale; int8, float32 for -min
    outlier_cols: torch.Tensor | None = None  # int64 [C], ascending: input columns kept in full precision
    outliers: torch.Tensor | None = None  # float32 [N, C]: their weights (the codes there dequantize to 0)

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    @property
    def group_size(self) -> int:
        return self.scheme.group_size or self.shape[1]

    @classmethod
    def quantize(cls, w: torch.Tensor, scheme: WeightScheme,
                 outlier_cols: torch.Tensor | None = None) -> "QuantizedTensor":
        """Round to nearest, one scale (and zero point) per group. Shrinking ranges to clip outliers was
        tried and measured: lower weight error, but higher KL on the GGUF models this runs on.
        `outlier_cols` are kept as they are and left out of the rounding (and of its scales)."""
        if outlier_cols is not None and outlier_cols.numel():
            if scheme.float_zero:  # the codes at kept columns must dequantize to exactly 0, which a -min grid lacks
                raise ConfigError(f"{scheme.name} keeps no outlier columns: its grid need not hold 0; use -asym",
                                  param="outlier_columns")
            cols = outlier_cols.to(torch.int64).sort().values
            rest = w.float().clone()
            rest[:, cols] = 0.0
            qt = cls.quantize(rest, scheme)
            qt.outlier_cols, qt.outliers = cols.contiguous(), w[:, cols].float().contiguous()
            return qt
        n, k = w.shape
        group = scheme.group_size or k
        groups = -(-k // group)
        # Zero-padding the last group keeps the math per group; padded columns are cut again below.
        wg = torch.nn.functional.pad(w.float(), (0, groups * group - k)).view(n, groups, group)
        q, scale, zp = _quantize_groups(wg, scheme)
        q = q.to(torch.int8).view(n, groups * group)[:, :k]
        return cls(scheme, q.contiguous(), scale.float(), None if zp is None else zero_point_as_stored(zp, scheme))

    def _per_column(self, t: torch.Tensor) -> torch.Tensor:
        """Expand a [N, groups] tensor to [N, K]."""
        return t.repeat_interleave(self.group_size, dim=1)[:, : self.shape[1]]

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: the weight the low-bit kernels compute with."""
        q = self.q.float()
        if self.zero_point is not None:
            q = q - self._per_column(self.zero_point.float())
        w = q * self._per_column(self.scale)
        if self.outliers is not None:
            w[:, self.outlier_cols] = self.outliers
        return w

    def rows(self, start: int, stop: int) -> "QuantizedTensor":
        """Output rows start..stop-1 (one member of a fused weight)."""
        def part(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[start:stop].contiguous()

        return QuantizedTensor(self.scheme, part(self.q), part(self.scale), part(self.zero_point),  # type: ignore[arg-type]
                               self.outlier_cols, part(self.outliers))

    def cols(self, start: int, stop: int) -> "QuantizedTensor":
        """Input columns start..stop-1 (a row-parallel rank's share): the same codes and scales, so its partial
        products add up to the whole weight's. The cut must fall on group boundaries."""
        group = self.scheme.group_size
        if self.outlier_cols is not None:
            raise ValueError("a weight with full-precision outlier columns cannot be split by columns")
        if group and (start % group or (stop % group and stop != self.shape[1])):
            raise ValueError(f"columns {start}..{stop} do not fall on the weight's groups of {group}")
        g0, g1 = (start // group, -(-stop // group)) if group else (0, 1)

        def part(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[:, g0:g1].contiguous()

        return QuantizedTensor(self.scheme, self.q[:, start:stop].contiguous(), part(self.scale),  # type: ignore[arg-type]
                               part(self.zero_point))

    @staticmethod
    def cat(parts: list["QuantizedTensor"]) -> "QuantizedTensor":
        """Stack along output rows (fusing q|k|v or gate|up); rows are quantized independently."""
        first = parts[0]
        if any(p.scheme != first.scheme or p.shape[1] != first.shape[1] for p in parts):
            raise CheckpointError(
                "fused projections (q|k|v, gate|up) must share one quantization scheme and input size; "
                f"got {[p.scheme.name for p in parts]}"
            )
        cols = first.outlier_cols
        if any((p.outlier_cols is None) != (cols is None) or (cols is not None and not torch.equal(p.outlier_cols, cols))
               for p in parts):
            raise CheckpointError("fused projections (q|k|v, gate|up) read one input, so they must keep the same "
                                  "outlier columns")

        def joined(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
            return None if ts[0] is None else torch.cat(ts)  # type: ignore[arg-type]

        return QuantizedTensor(first.scheme, torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                               joined([p.zero_point for p in parts]), cols, joined([p.outliers for p in parts]))

    # ---- compressed-tensors layout ---------------------------------------------------------------

    def to_state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        """Tensors for `prefix` (e.g. `model.layers.0.mlp.down_proj.`)."""
        out = {prefix + "weight_scale": self.scale.to(torch.float32)}
        if self.scheme.bits == 8:
            out[prefix + "weight"] = self.q
        else:
            out[prefix + "weight_packed"] = pack_int4(self.q)
            out[prefix + "weight_shape"] = torch.tensor(self.shape, dtype=torch.int64)
        if self.zero_point is not None:
            out[prefix + "weight_zero_point"] = self.zero_point
        if self.outliers is not None:
            out[prefix + "weight_outlier_columns"] = self.outlier_cols  # type: ignore[assignment]
            out[prefix + "weight_outliers"] = self.outliers.to(torch.float32)
        return out

    @classmethod
    def from_state_dict(cls, tensors: dict[str, torch.Tensor], prefix: str, scheme: WeightScheme,
                        source: str) -> "QuantizedTensor":
        def need(name: str) -> torch.Tensor:
            if prefix + name not in tensors:
                raise CheckpointError(f"{source}: quantized layer {prefix[:-1]} ({scheme.name}) lacks {prefix + name}")
            return tensors[prefix + name]

        scale = need("weight_scale").float()
        zp = tensors.get(prefix + "weight_zero_point")
        if scheme.bits == 8:
            q = need("weight").to(torch.int8)
        else:
            n, k = (int(v) for v in need("weight_shape").tolist())
            q = unpack_int4(need("weight_packed"), k)
        groups = -(-q.shape[1] // (scheme.group_size or q.shape[1]))
        if tuple(scale.shape) != (q.shape[0], groups):
            raise CheckpointError(
                f"{source}: {prefix}weight_scale has shape {tuple(scale.shape)}, expected {(q.shape[0], groups)} "
                f"for {scheme.name}"
            )
        if not scheme.symmetric and zp is None:
            raise CheckpointError(f"{source}: asymmetric layer {prefix[:-1]} lacks {prefix}weight_zero_point")
        cols, outliers = tensors.get(prefix + "weight_outlier_columns"), tensors.get(prefix + "weight_outliers")
        if (cols is None) != (outliers is None) or (
                cols is not None and (cols.dim() != 1 or tuple(outliers.shape) != (q.shape[0], cols.numel())  # type: ignore[union-attr]
                                      or not bool(((cols >= 0) & (cols < q.shape[1])).all()))):
            raise CheckpointError(f"{source}: {prefix}weight_outlier_columns and {prefix}weight_outliers must come "
                                  f"together, as [C] column indices below {q.shape[1]} and [{q.shape[0]}, C] weights")
        return cls(scheme, q, scale, None if zp is None else zero_point_as_stored(zp, scheme),
                   None if cols is None else cols.to(torch.int64).contiguous(),
                   None if outliers is None else outliers.float().contiguous())


def zero_point_as_stored(zp: torch.Tensor, scheme: WeightScheme) -> torch.Tensor:
    return zp.float() if scheme.float_zero else zp.to(torch.int8)


def _quantize_groups(wg: torch.Tensor, scheme: WeightScheme) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """wg [n, groups, group] -> q (float, integral values), scale [n, groups], zero point or None."""
    if scheme.symmetric:
        half_range = (scheme.qmax - scheme.qmin) / 2 if scheme.bits == 4 else scheme.qmax
        scale = wg.abs().amax(-1) / half_range
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return torch.round(wg / scale.unsqueeze(-1)).clamp(scheme.qmin, scheme.qmax), scale, None
    lo, hi = wg.amin(-1), wg.amax(-1)
    if not scheme.float_zero:  # an integer zero point: the range holds 0, so zero weights (and padding) stay exactly 0
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    scale = (hi - lo) / (scheme.qmax - scheme.qmin)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if scheme.float_zero:  # the group's minimum is the offset: w = (q - qmin) * scale + lo
        q = torch.round((wg - lo.unsqueeze(-1)) / scale.unsqueeze(-1)) + scheme.qmin
        return q.clamp(scheme.qmin, scheme.qmax), scale, scheme.qmin - lo / scale
    zp = (scheme.qmin - torch.round(lo / scale)).clamp(scheme.qmin, scheme.qmax)
    q = (torch.round(wg / scale.unsqueeze(-1)) + zp.unsqueeze(-1)).clamp(scheme.qmin, scheme.qmax)
    return q, scale, zp


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], [N, K] -> int32 [N, ceil(K / 8)], value j of a word in bits 4j..4j+3."""
    n, k = q.shape
    u = torch.nn.functional.pad((q.to(torch.int32) + 8), (0, -k % 8)).view(n, -1, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (u << shifts).sum(-1, dtype=torch.int64).to(torch.int64).bitwise_and(0xFFFFFFFF).to(torch.int32)


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    u = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF
    return (u.view(packed.shape[0], -1)[:, :k] - 8).to(torch.int8)
