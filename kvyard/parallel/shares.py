"""How a parallel replica shares things out: `total` items in `parts` contiguous, near-equal shares, the first
`total % parts` shares one item longer. The vocabulary's rows over tensor-parallel ranks, the layers over
pipeline stages, the experts over ranks (contiguous placement) and the cores over a replica's processes all
split this way."""


def contiguous_share(total: int, parts: int, index: int) -> range:
    """Share `index` of `parts`: the items it holds."""
    size, extra = divmod(total, parts)
    start = index * size + min(index, extra)
    return range(start, start + size + (index < extra))
