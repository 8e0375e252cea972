"""The devices `kvyard plan` sizes deployments for (#38): memory, bandwidth, dense FLOPs per dtype, interconnect.

Vendor figures for one GPU (SXM or NVL parts), dense (no 2:4 sparsity). `this` is the machine the planner runs
on: its memory from /proc/meminfo; its measured rates come with the calibration.
"""

import os
from dataclasses import dataclass, field

from kvyard.errors import ConfigError

TB = 1e12


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: float
    bandwidth: float  # bytes/s of its memory
    flops: dict[str, float] = field(default_factory=dict)  # dense, by compute format
    link: float = 0.0  # bytes/s one way to a peer (NVLink), 0: none
    note: str = ""
    # Measured only (kvyard.plan.measure): rows -> bytes of weights a second the engine's matmuls stream at
    # that many rows, computing as they go; empty: the rooflines stand in
    stream: dict[int, float] = field(default_factory=dict)
    # One host whose cores and memory a layout's ranks share (this machine), not one device a rank
    one_host: bool = False


CATALOGUE = {d.name: d for d in (
    Device("h100", 80e9, 3.35 * TB, {"bfloat16": 989e12, "fp8": 1979e12}, 450e9, "H100 SXM, HBM3"),
    Device("h200", 141e9, 4.8 * TB, {"bfloat16": 989e12, "fp8": 1979e12}, 450e9, "H200 SXM, HBM3e"),
    Device("b200", 180e9, 8 * TB, {"bfloat16": 2.25e15, "fp8": 4.5e15, "nvfp4": 9e15}, 900e9,
           "B200 HGX, HBM3e (180 GB usable)"),
    Device("gb300", 288e9, 8 * TB, {"bfloat16": 2.5e15, "fp8": 5e15, "nvfp4": 15e15}, 900e9,
           "GB300 (Blackwell Ultra), 288 GB HBM3e advertised"),
)}


def this_machine() -> Device:
    """This host's memory (MemTotal); its rates are measured by the calibration, not assumed."""
    try:
        with open("/proc/meminfo") as f:
            total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Device("this", float(total), 0.0, note=f"this machine, {os.cpu_count()} CPUs", one_host=True)


def device(name: str) -> Device:
    if name == "this":
        return this_machine()
    if name not in CATALOGUE:
        raise ConfigError(f"unknown device {name!r}; known: {', '.join([*CATALOGUE, 'this'])}", param="hardware")
    return CATALOGUE[name]
