from kvyard.quant.scheme import WeightScheme, parse_weight_scheme


def scheme(name: str) -> WeightScheme:
    """parse_weight_scheme, plus `int8-g<G>[-min]`: int8 in groups along K (with a float zero point), which no
    `--scheme` offers but GGUF's Q8_0, Q5_0 and Q5_1 load as (loader/gguf_native.py)."""
    if name.startswith("int8-g"):
        group, _, zero = name.removeprefix("int8-g").partition("-")
        return WeightScheme(bits=8, group_size=int(group), symmetric=zero != "min", float_zero=zero == "min")
    return parse_weight_scheme(name)
