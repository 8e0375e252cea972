from kvyard.quant.scheme import WeightScheme, parse_weight_scheme


def scheme(name: str) -> WeightScheme:
    """parse_weight_scheme, plus `int8-g<G>`: int8 in groups along K, which no `--scheme` offers but GGUF's Q8_0
    loads as (loader/gguf_native.py)."""
    if name.startswith("int8-g"):
        return WeightScheme(bits=8, group_size=int(name.removeprefix("int8-g")))
    return parse_weight_scheme(name)
