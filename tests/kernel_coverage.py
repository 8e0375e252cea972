"""Which of kvyard's CPU kernel paths this machine exercised in the test run, and which it skipped.

The CPU changes from machine to machine (AMX Xeon, AVX-512 EPYC, AVX2-only EPYC), and each kernel path's
tests skip where the CPU lacks it. `make test` prints this report at its end (tests/conftest.py), so every
run says what it did not check; the closing notes record it, and BENCHMARKS.md's kernel table names paths
that have not run on any machine since they last changed.
"""

from collections import Counter
from collections.abc import Callable
from pathlib import Path

# Skip reasons that mean "this CPU lacks a kernel path" (as the kernel tests word them), lower case.
KERNEL_SKIP_WORDS = ("amx", "avx512", "avx-512", "vnni", "onednn", "kernels did not build", "this cpu has no",
                     "int16 path", "exact vector loop")


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def kernel_paths() -> list[tuple[str, Callable[[], bool]]]:
    """(path, whether it runs here), in the order a bf16 or low-bit matmul prefers them."""
    import torch

    from kvyard.kernels import cpu

    flags = cpu_flags()
    return [
        ("AMX tiles (amx_linear, amx_linear_lowbit)", cpu.amx_available),
        ("AVX512-BF16 dot products (dpbf16_linear)", cpu.dpbf16_available),
        ("AVX-512 VNNI low-bit (vnni_lowbit_linear)", cpu.vnni_lowbit_available),
        ("oneDNN bf16 GEMM (torch)", torch.ops.mkldnn._is_mkldnn_bf16_supported),
        ("kvyard few-row bf16 and portable low-bit, AVX-512 build",
         lambda: cpu.available() and "avx512f" in flags),
        ("kvyard few-row bf16 and portable low-bit, AVX2 build (widened_rows.h)",
         lambda: cpu.available() and "avx2" in flags and "avx512f" not in flags),
        ("kvyard int8-activation low-bit, AVX2 integer dots (lowbit_linear_i8, --dynamic-quant)",
         cpu.int8_act_available),
        ("kvyard C++ kernels at all (attention, norms, decode stack)", cpu.available),
    ]


def report(skipped_reasons: list[str]) -> list[str]:
    """Lines for the end of the run: each path, exercised or skipped here, then the kernel tests skipped."""
    lines = []
    for name, runs in kernel_paths():
        try:
            ok = bool(runs())
        except Exception as e:  # noqa: BLE001 - a report must not fail the run
            ok, name = False, f"{name} (check failed: {e})"
        lines.append(f"{'exercised' if ok else 'SKIPPED  '}  {name}")
    counts = Counter(r for r in skipped_reasons if any(w in r.lower() for w in KERNEL_SKIP_WORDS))
    total = sum(counts.values())
    lines.append(f"{total} kernel tests skipped for want of a path on this CPU" + (":" if total else ""))
    lines += [f"  {n:4d}  {reason}" for reason, n in counts.most_common()]
    return lines
