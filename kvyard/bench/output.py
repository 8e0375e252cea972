"""How a benchmark hands over its result: JSON on stdout, and the same in a file when asked."""

import json
import platform
from pathlib import Path

import torch


def emit_json(result: dict, json_out: str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(text + "\n")


# CPU features the kernels choose their paths by: a result means little without knowing which ran.
_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")


def machine_info() -> dict:
    """Threads, platform, CPU model and the instruction-set extensions kvyard's kernels look for."""
    info: dict = {"cpu_threads": torch.get_num_threads(), "platform": platform.platform()}
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux: the platform string is all there is
        return info
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    info["cpu"] = fields.get("model name")
    info["cpu_flags"] = [f for f in _CPU_FLAGS if f in flags]
    return info
