"""keep_freed_memory: freed activation-sized blocks are reused, not faulted back in from the OS."""

import subprocess
import sys

import pytest

# A step that allocates three 20 MB blocks, touches them and frees them, as a prefill step does with its
# activations; prints the minor page faults of ten such steps after two warm-up steps.
STEP_FAULTS = """
import ctypes, resource, sys
from kvyard.engine.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def step():
    blocks = [libc.malloc(20 << 20) for _ in range(3)]
    for b in blocks:
        libc.memset(b, 1, 20 << 20)
    for b in blocks:
        libc.free(b)
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _step_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", STEP_FAULTS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc thresholds")
def test_freed_blocks_are_reused_instead_of_faulted_back_in():
    default, kept = _step_faults("default"), _step_faults("keep")
    assert default > 10 * 3 * (20 << 20) // 4096 // 2  # glibc's defaults: most pages fault in every step
    assert kept < 100  # kept: the heap's freed blocks serve the next step


def test_opt_out(monkeypatch):
    import kvyard.engine.host_memory as host_memory

    monkeypatch.setattr(host_memory, "_applied", False)
    monkeypatch.setenv("KVYARD_KEEP_FREED_MEMORY", "0")
    assert host_memory.keep_freed_memory() is False
