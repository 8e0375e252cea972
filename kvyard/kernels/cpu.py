"""kvyard's hand-written CPU kernels (csrc/), compiled once per machine and cached.

The first use builds them with PyTorch's JIT extension builder (about 40 s on 2 cores; the result is kept in
PyTorch's extensions cache, keyed by the source). Where no compiler is available, or with
KVYARD_CPU_KERNELS=0, the callers fall back to plain PyTorch ops: same results within rounding, slower.
"""

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "decode_attention.cpp", _CSRC / "norm_act.cpp", _CSRC / "rope_kv.cpp", _CSRC / "amx_linear.cpp",
            _CSRC / "amx_lowbit.cpp", _CSRC / "lowbit_linear.cpp", _CSRC / "linear_bf16.cpp",
            _CSRC / "dpbf16_linear.cpp", _CSRC / "vnni_lowbit.cpp", _CSRC / "decode_stack.cpp",
            _CSRC / "lora.cpp", _CSRC / "lowbit_int8_act.cpp"]
_HEADERS = [_CSRC / "vec.h", _CSRC / "amx.h", _CSRC / "widened_rows.h", _CSRC / "ops.h", _CSRC / "vnni_blocks.h",
            _CSRC / "lowbit_layout.h", _CSRC / "attention_lanes.h",
            _CSRC / "attend_tile.h", _CSRC / "attend_tile_dp.h"]
_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet


def _enabled_by_env(name: str) -> bool:
    return os.environ.get(name, "1") not in ("0", "false", "no")


def available() -> bool:
    """True when torch.ops.kvyard.* can be called (building them on first call)."""
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                _loaded = _enabled_by_env("KVYARD_CPU_KERNELS") and _build()
    return _loaded


def amx_available() -> bool:
    """True when torch.ops.kvyard.amx_linear runs here: the kernels are loaded, they were compiled for a CPU
    with AMX, the OS granted the tile state, and KVYARD_AMX is not 0 (which keeps oneDNN's GEMM)."""
    return available() and _enabled_by_env("KVYARD_AMX") and bool(torch.ops.kvyard.amx_available())


def vnni_lowbit_available() -> bool:
    """True when torch.ops.kvyard.vnni_lowbit_linear runs here: the kernels are loaded and were compiled for a CPU
    with AVX-512 BW, VNNI and BF16."""
    return available() and bool(torch.ops.kvyard.vnni_lowbit_available())


def int8_act_available() -> bool:
    """True when torch.ops.kvyard.lowbit_linear_i8 (low-bit weights against int8-rounded activations) runs here:
    the kernels are loaded and were compiled for a CPU with AVX2 and FMA."""
    return available() and bool(torch.ops.kvyard.lowbit_int8_act_available())


def prompt_attention_tiles(head_dim: int, group: int) -> bool:
    """True when a prompt's tokens can be attended as rows of torch.ops.kvyard.paged_decode_attention, tiled
    (csrc/attend_tile.h): the kernels are loaded with their register path for this head size and query heads per KV
    head, and KVYARD_PROMPT_TILES is not 0 (which keeps SDPA for the prompts of the default path)."""
    return (available() and _enabled_by_env("KVYARD_PROMPT_TILES")
            and bool(torch.ops.kvyard.paged_attention_tiles(head_dim, group)))


def attention_dp_available(head_dim: int) -> bool:
    """True when torch.ops.kvyard.paged_attention_dp runs here for this head size: the kernels are loaded and
    were compiled for a CPU with AVX512-BF16, and KVYARD_ATTENTION_DPBF16 is not 0 (which keeps prompts on the decode kernel's
    fp32 tiles, and the batch-invariant path's decodes on its fp32 chain)."""
    return (available() and _enabled_by_env("KVYARD_ATTENTION_DPBF16")
            and bool(torch.ops.kvyard.paged_attention_dp_available(head_dim)))


def decode_stack_enabled() -> bool:
    """Whether decode steps may run their layers in one C++ call (kvyard/models/decode_stack.py);
    KVYARD_DECODE_STACK=0 keeps the layer-by-layer path."""
    return _enabled_by_env("KVYARD_DECODE_STACK")


def dpbf16_available() -> bool:
    """True when torch.ops.kvyard.dpbf16_linear runs here: the kernels are loaded and were compiled for a CPU
    with AVX512-BF16 (KVYARD_DPBF16=0 keeps oneDNN's GEMM instead)."""
    return available() and _enabled_by_env("KVYARD_DPBF16") and bool(torch.ops.kvyard.dpbf16_available())


# -fopenmp: at::parallel_for is a header template, parallel only when compiled with OpenMP; the extension
# then shares the libgomp torch has already loaded. -fno-trapping-math lets GCC vectorise floor() and
# selects (exp, silu); results are the same IEEE values. -ffp-contract=off: no a * b + c fused into one
# rounding where PyTorch rounds the product first.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-ffp-contract=off"]
_OPS = ("paged_decode_attention", "rms_norm", "add_rms_norm_", "silu_mul", "rope_write_kv_", "amx_linear",
        "amx_linear_lowbit", "lowbit_linear", "lowbit_dequantize", "linear_bf16", "dpbf16_linear",
        "dpbf16_linear_f32", "vnni_lowbit_linear", "lowbit_linear_i8", "paged_attention_tiles",
        "paged_attention_dp")


# A build takes about 40 s here. torch's build lock is a bare file that a killed build leaves behind, and
# every later load then waits on it forever; one older than this is taken to be such a leftover.
STALE_LOCK_S = 900.0


def clear_stale_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove `build_dir`/lock when it is older than `max_age_s`; True when it did."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= max_age_s:
        return False
    log.warning("removing %s, left %.0f s ago by a kernel build that did not finish", lock, age)
    lock.unlink(missing_ok=True)
    return True


def _build() -> bool:
    from torch.utils.cpp_extension import _get_build_directory, load

    # The name carries a hash of every source, header and flag: any edit gets a fresh build, never a stale
    # cached library.
    parts = [p.read_bytes() for p in _SOURCES + _HEADERS] + [" ".join(_CFLAGS).encode()]
    digest = hashlib.sha256(b"".join(parts)).hexdigest()[:12]
    log.info("loading kvyard's CPU kernels (the first use on a machine compiles them, about 40 s)")
    name = f"kvyard_cpu_ops_{digest}"
    clear_stale_lock(Path(_get_build_directory(name, verbose=False)))
    try:
        load(
            name=name,
            sources=[str(p) for p in _SOURCES],
            extra_include_paths=[str(_CSRC)],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, an unsupported platform: fall back, loudly
        log.warning("CPU kernels unavailable (%s: %s); using plain PyTorch ops", type(exc).__name__, exc)
        return False
    return all(hasattr(torch.ops.kvyard, op) for op in _OPS)
