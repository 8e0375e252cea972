import math


def same_kl(kl: float, kl_again: float) -> bool:
    """Whether two float32 measurements of one model's KL agree. They are not always bit-equal: in 3 of 12
    runs of test_bench_quant_tiny (whatever PYTHONHASHSEED) the re-measure came out 0.1-1 % apart, at two
    fixed values, as a float32 kernel that rounds an ulp differently from run to run would give. A logit
    noise of d moves a KL by about 2 * sqrt(KL) * d; this allows d = 2.5e-5, far below the logit changes
    that a different measurement (a bf16 model, another checkpoint) brings."""
    return abs(kl_again - kl) <= 1e-4 * kl + 5e-5 * math.sqrt(kl)
