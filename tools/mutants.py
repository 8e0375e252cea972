"""Mutation spot-checks: break a handful of named places, one at a time, and confirm a test fails for each.

    .venv/bin/python tools/mutants.py            # all mutants; exit 1 if any survives
    .venv/bin/python tools/mutants.py abort      # only the named ones

Each mutant is one exact text replacement in one source file, undone afterwards whatever happens, and the
tests that guard that place. A mutant is "caught" when those tests fail against it. The script first checks
that each snippet is present once, so a refactor that moves the code makes the script fail loudly rather
than report a mutant that was never applied.
"""

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTEST = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
TIMEOUT_S = 600


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    original: str
    broken: str
    tests: tuple[str, ...]


MUTANTS = [
    Mutant("abort", "kvyard/server/async_engine.py",
           "            if not finished:\n                self.abort_nowait(request_id)",
           "            if not finished:\n                pass",
           ("tests/server/test_async_engine.py", "tests/server/test_load_and_cancel.py")),
    Mutant("close-never-aborts", "kvyard/server/generation.py",
           "                choice.finished = True\n                self.ctx.engine.abort_nowait(choice.request_id)",
           "                choice.finished = True",
           ("tests/server/test_load_and_cancel.py::test_raw_socket_hangup_before_response",)),
    Mutant("stop-token", "kvyard/engine/llm_engine.py",
           "if token in p.stop_token_ids:", "if False and token in p.stop_token_ids:",
           ("tests/engine/test_engine.py",)),
    Mutant("max-tokens", "kvyard/engine/llm_engine.py",
           "if req.num_output_tokens >= p.max_tokens or", "if req.num_output_tokens > p.max_tokens or",
           ("tests/engine/test_engine.py",)),
    Mutant("prefix-hash-parent", "kvyard/engine/block_manager.py",
           "h = hashlib.sha256(parent or ROOT_HASH)", "h = hashlib.sha256(ROOT_HASH)",
           ("tests/engine/test_block_manager.py",)),
    Mutant("rejection-residual", "kvyard/spec/rejection.py",
           "residual = (residual - q.float().to(p.device)).clamp_(min=0.0)", "residual = residual",
           ("tests/spec/test_rejection.py",)),
    Mutant("kv-transfer-checksum", "kvyard/disagg/zmq_fetcher.py",
           "if sums is not None and wire.checksum(wire.as_bytes(f)) != sums[k]:",
           "if False and sums is not None and wire.checksum(wire.as_bytes(f)) != sums[k]:",
           ("tests/disagg/test_transport.py",)),
]


def run(m: Mutant) -> tuple[bool, float, str]:
    """(caught, seconds, last line of pytest's output) with `m` applied; the file is restored after."""
    path = ROOT / m.path
    source = path.read_text()
    if source.count(m.original) != 1:
        raise SystemExit(f"{m.name}: the snippet is not in {m.path} exactly once; update tools/mutants.py")
    for t in m.tests:
        if not (ROOT / t.split("::")[0]).exists():
            raise SystemExit(f"{m.name}: no such test file {t}")
    start = time.monotonic()
    try:
        path.write_text(source.replace(m.original, m.broken))
        proc = subprocess.run([*PYTEST, *m.tests], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
        caught = proc.returncode != 0
        tail = (proc.stdout.strip().splitlines() or [""])[-1]
    except subprocess.TimeoutExpired:
        caught, tail = True, f"timed out after {TIMEOUT_S} s (counted as caught: the tests did not pass)"
    finally:
        path.write_text(source)
    return caught, time.monotonic() - start, tail


def main(names: list[str]) -> int:
    chosen = [m for m in MUTANTS if not names or m.name in names]
    unknown = set(names) - {m.name for m in MUTANTS}
    if unknown:
        print(f"unknown mutants: {sorted(unknown)}; known: {[m.name for m in MUTANTS]}")
        return 2
    survived = []
    for m in chosen:
        caught, seconds, tail = run(m)
        print(f"{m.name:24s} {'caught' if caught else 'SURVIVED':8s} {seconds:6.1f} s  {tail}", flush=True)
        if not caught:
            survived.append(m.name)
    print(f"{len(chosen) - len(survived)} of {len(chosen)} mutants caught" +
          (f"; survived: {', '.join(survived)}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
