import pytest
import torch

from kvyard.errors import CheckpointError, ConfigError
from kvyard.quant.qtensor import QuantizedTensor, pack_int4, unpack_int4
from kvyard.quant.scheme import parse_weight_scheme

SCHEMES = ["int8", "int4-g32", "int4-g64-asym", "int4-g128", "int4-g128-asym"]
GRIDS = SCHEMES + ["int4-g32-min", "int4-g128-min"]  # -min: a float zero point, and no outlier columns


@pytest.mark.parametrize("name", GRIDS)
@pytest.mark.parametrize("shape", [(96, 200), (64, 128), (7, 33)])
def test_error_is_within_half_a_step(name, shape):
    torch.manual_seed(0)
    w = torch.randn(shape)
    qt = QuantizedTensor.quantize(w, parse_weight_scheme(name))
    assert qt.q.dtype == torch.int8 and qt.shape == shape
    assert int(qt.q.min()) >= qt.scheme.qmin and int(qt.q.max()) <= qt.scheme.qmax
    step = qt._per_column(qt.scale)
    # Rounding error is at most half a step; symmetric int4 also clips the largest value by half a step.
    assert ((qt.dequantize() - w).abs() <= step * 0.5 + 1e-6).all()


def test_asymmetric_keeps_zero_exact():
    w = torch.rand(64, 128) + 0.5  # all positive: the range is widened to include 0
    w[:, ::7] = 0.0
    qt = QuantizedTensor.quantize(w, parse_weight_scheme("int4-g32-asym"))
    assert (qt.dequantize()[:, ::7] == 0).all()


def test_float_zero_point_gives_back_a_weight_on_its_grid():
    """A weight already on a 16-level grid per 32 inputs with a float offset (what GGUF's Q4_1 stores) comes back
    from int4-g32-min to float rounding; an integer zero point cannot follow the offsets."""
    torch.manual_seed(0)
    n, k = 48, 256
    step, offset = torch.rand(n, k // 32, 1) * 0.1 + 0.01, torch.randn(n, k // 32, 1) * 0.1
    codes = torch.randint(0, 16, (n, k // 32, 32))
    codes[..., 0], codes[..., 1] = 0, 15  # each group spans the whole grid, as a quantizer leaves it
    w = (step * codes + offset).view(n, k)
    qt = QuantizedTensor.quantize(w, parse_weight_scheme("int4-g32-min"))
    assert qt.zero_point is not None and qt.zero_point.dtype == torch.float32
    assert (qt.dequantize() - w).abs().max() < 1e-6
    asym = QuantizedTensor.quantize(w, parse_weight_scheme("int4-g32-asym"))
    assert (asym.dequantize() - w).abs().max() > 1e-3


def test_float_zero_point_keeps_no_outlier_columns():
    with pytest.raises(ConfigError, match="outlier columns"):
        QuantizedTensor.quantize(torch.randn(16, 64), parse_weight_scheme("int4-g32-min"), torch.tensor([3]))


def test_pack_unpack_roundtrip():
    q = torch.randint(-8, 8, (5, 19), dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (5, 3)
    assert torch.equal(unpack_int4(packed, 19), q)


@pytest.mark.parametrize("name", GRIDS)
def test_state_dict_roundtrip(name):
    qt = QuantizedTensor.quantize(torch.randn(64, 96), parse_weight_scheme(name))
    sd = qt.to_state_dict("layer.")
    back = QuantizedTensor.from_state_dict(sd, "layer.", qt.scheme, "test")
    assert torch.equal(back.q, qt.q) and torch.equal(back.scale, qt.scale)
    assert torch.equal(back.dequantize(), qt.dequantize())


def test_missing_part_names_the_tensor():
    qt = QuantizedTensor.quantize(torch.randn(64, 96), parse_weight_scheme("int4-g32"))
    sd = qt.to_state_dict("model.layers.0.mlp.down_proj.")
    del sd["model.layers.0.mlp.down_proj.weight_scale"]
    with pytest.raises(CheckpointError, match="down_proj.weight_scale"):
        QuantizedTensor.from_state_dict(sd, "model.layers.0.mlp.down_proj.", qt.scheme, "ckpt")


def test_cat_equals_quantizing_the_fused_matrix():
    s = parse_weight_scheme("int4-g32-asym")
    a, b = torch.randn(64, 96), torch.randn(32, 96)
    fused = QuantizedTensor.cat([QuantizedTensor.quantize(a, s), QuantizedTensor.quantize(b, s)])
    direct = QuantizedTensor.quantize(torch.cat([a, b]), s)
    assert torch.equal(fused.dequantize(), direct.dequantize())


def test_cat_refuses_mixed_schemes():
    a = QuantizedTensor.quantize(torch.randn(64, 96), parse_weight_scheme("int8"))
    b = QuantizedTensor.quantize(torch.randn(64, 96), parse_weight_scheme("int4-g32"))
    with pytest.raises(CheckpointError, match="one quantization scheme"):
        QuantizedTensor.cat([a, b])


def test_rows_undo_cat():
    scheme = parse_weight_scheme("int4-g32-asym")
    a, b = QuantizedTensor.quantize(torch.randn(8, 64), scheme), QuantizedTensor.quantize(torch.randn(5, 64), scheme)
    fused = QuantizedTensor.cat([a, b])
    for part, got in ((a, fused.rows(0, 8)), (b, fused.rows(8, 13))):
        assert torch.equal(got.q, part.q) and torch.equal(got.scale, part.scale)
        assert torch.equal(got.zero_point, part.zero_point)


@pytest.mark.parametrize("name", SCHEMES)
def test_outlier_columns_stay_exact_and_leave_the_scales(name):
    """Kept columns come back exactly, their codes dequantize to 0, and they no longer set their rows' scales."""
    torch.manual_seed(0)
    w = torch.randn(16, 128)
    w[:, 7] *= 50.0  # an outlier column, as large activations meet in LLM layers
    cols = torch.tensor([90, 7])
    qt = QuantizedTensor.quantize(w, parse_weight_scheme(name), cols)
    assert qt.outlier_cols.tolist() == [7, 90]  # kept in ascending order
    d = qt.dequantize()
    assert torch.equal(d[:, [7, 90]], w[:, [7, 90]])
    plain = QuantizedTensor.quantize(w, parse_weight_scheme(name))
    rest = [c for c in range(128) if c not in (7, 90)]
    assert (d - w)[:, rest].abs().max() < (plain.dequantize() - w)[:, rest].abs().max() / 5
    no_outliers = QuantizedTensor(qt.scheme, qt.q, qt.scale, qt.zero_point)
    assert no_outliers.dequantize()[:, [7, 90]].abs().max() == 0


def test_outlier_columns_survive_state_dict_rows_and_cat():
    w = torch.randn(12, 64)
    qt = QuantizedTensor.quantize(w, parse_weight_scheme("int8"), torch.tensor([3, 40]))
    back = QuantizedTensor.from_state_dict(qt.to_state_dict("p."), "p.", qt.scheme, "ckpt")
    assert torch.equal(back.dequantize(), qt.dequantize())
    assert torch.equal(QuantizedTensor.cat([qt.rows(0, 5), qt.rows(5, 12)]).dequantize(), qt.dequantize())
    other = QuantizedTensor.quantize(w, parse_weight_scheme("int8"), torch.tensor([4]))
    with pytest.raises(CheckpointError, match="same outlier columns"):
        QuantizedTensor.cat([qt, other])


def test_broken_outlier_tensors_name_the_layer():
    qt = QuantizedTensor.quantize(torch.randn(8, 64), parse_weight_scheme("int8"), torch.tensor([1, 2]))
    parts = qt.to_state_dict("model.layers.0.mlp.down_proj.")
    lonely = {k: v for k, v in parts.items() if not k.endswith("weight_outliers")}
    with pytest.raises(CheckpointError, match="down_proj.weight_outlier_columns"):
        QuantizedTensor.from_state_dict(lonely, "model.layers.0.mlp.down_proj.", qt.scheme, "ckpt")
    parts["model.layers.0.mlp.down_proj.weight_outlier_columns"] = torch.tensor([1, 64])  # past the last column
    with pytest.raises(CheckpointError, match="below 64"):
        QuantizedTensor.from_state_dict(parts, "model.layers.0.mlp.down_proj.", qt.scheme, "ckpt")
