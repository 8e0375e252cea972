import pytest

from kvyard.errors import ConfigError
from kvyard.quant.scheme import WeightScheme, check_rounding, parse_quant_request, parse_weight_scheme


@pytest.mark.parametrize(
    "name, expected",
    [
        ("int8", WeightScheme(8)),
        ("int4-g32", WeightScheme(4, 32, True)),
        ("int4-g64-asym", WeightScheme(4, 64, False)),
        ("int4-g128", WeightScheme(4, 128, True)),
        ("int4-g32-min", WeightScheme(4, 32, False, float_zero=True)),
    ],
)
def test_parse_weight_scheme(name, expected):
    s = parse_weight_scheme(name)
    assert s == expected
    assert s.name == name


@pytest.mark.parametrize("bad", ["int3", "int4", "int4-g100", "int4-g128-foo", "fp8", ""])
def test_bad_scheme_is_a_clear_error(bad):
    with pytest.raises(ConfigError, match="scheme|group size"):
        parse_weight_scheme(bad)


def test_mixed_request_uses_the_mixed_weight_format():
    req = parse_quant_request("mixed", "int4-g64")
    assert req.mixed and req.weight == WeightScheme(4, 64, True)
    assert not parse_quant_request("int8").mixed


def test_int_ranges():
    assert (WeightScheme(8).qmin, WeightScheme(8).qmax) == (-127, 127)
    assert (WeightScheme(4, 32).qmin, WeightScheme(4, 32).qmax) == (-8, 7)


def test_check_rounding():
    assert check_rounding("gptq") == "gptq" and check_rounding("rtn") == "rtn"
    with pytest.raises(ConfigError, match="rounding"):
        check_rounding("awq")
