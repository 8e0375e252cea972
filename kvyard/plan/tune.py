"""`kvyard tune`: every candidate deployment run for real and measured by its goodput (#38).

For each candidate (kvyard.plan.tune_space), in order:
1. a candidate that would need more memory than one that already ran out is skipped, as learned;
2. one that changes numerics (quantization, KV dtype, dtype) goes through the fidelity gate first: its model,
   loaded as the engine would load it, is measured against the full-precision one on kvyard quantize's
   calibration text; past the KL budget it is not run;
3. it is started (`kvyard serve`, or `kvyard up` with a cluster section) and its goodput searched
   (kvyard.plan.goodput), `repeats` times, each on a freshly started deployment so that no run finds the
   caches (prefix cache, KV tiers) the previous one filled;
4. a deployment that does not start, dies or runs out of memory is an infeasible point: recorded with the
   reason and the sweep goes on.
Each candidate's row is appended to results.jsonl as soon as it is measured; a rerun with the same --out
skips what is there, so an interrupted sweep resumes where it stopped.
"""

import json
import logging
import shlex
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvyard.bench.compare_serve import ManagedServer, wait_port_free
from kvyard.bench.serve_run import BenchError
from kvyard.config import EngineConfig
from kvyard.errors import KvyardError
from kvyard.plan.goodput import GoodputSearch, goodput_of
from kvyard.plan.tune_space import Candidate, larger_than_failed
from kvyard.router.launcher import kvyard_command
from kvyard.shadow.compare import Budgets

log = logging.getLogger("kvyard.tune")
OOM_SIGNS = ("out of memory", "memoryerror", "cannot allocate memory", "not enough memory", "oom")


@dataclass
class TuneOptions:
    out: Path
    search: GoodputSearch  # its url is set per candidate
    repeats: int = 2
    port: int = 8790
    ready_timeout: float = 300.0
    kl_budget: float = Budgets().kl_mean  # mean KL (nats a token) a candidate that changes numerics may reach


class FidelityGate:
    """KL of a candidate's numerics against the base model in the base's dtype, measured once per numerics."""

    def __init__(self, model: str, dtype: str):
        self.model, self.dtype = model, dtype
        self._reference: Any = None
        self._seen: dict[tuple[Any, ...], dict[str, float]] = {}

    def measure(self, c: Candidate) -> dict[str, float]:
        from kvyard.quant.tool import QuantizeOptions, load_reference, served_fidelity

        numerics = (str(c.value(("engine", "dtype"))), c.value(("engine", "quantization")),
                    c.value(("engine", "kv_cache_dtype")))
        if numerics not in self._seen:
            if self._reference is None:
                self._reference = load_reference(QuantizeOptions(self.model, scheme="none", dtype=self.dtype,
                                                                 progress=False, tool_eval=False))
            dtype, quantization, kv = numerics
            self._seen[numerics] = served_fidelity(self._reference, dtype, quantization, kv == "int8").as_dict()
        return self._seen[numerics]


def read_results(path: Path) -> dict[str, dict[str, Any]]:
    """The rows already measured, by candidate key (a torn last line, from a killed run, is ignored)."""
    rows: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows[row["key"]] = row
    return rows


class Tuner:
    def __init__(self, opts: TuneOptions, cands: list[Candidate]):
        self.opts, self.cands = opts, cands
        self.base = cands[0]
        model = self.base.settings["engine"].get("model", EngineConfig.model)
        self.gate = FidelityGate(model, str(self.base.value(("engine", "dtype"))))
        opts.out.mkdir(parents=True, exist_ok=True)
        self.results_path = opts.out / "results.jsonl"
        self.rows = read_results(self.results_path)

    def run(self) -> list[dict[str, Any]]:
        for i, c in enumerate(self.cands):
            if c.key in self.rows:
                log.info("[%d/%d] %s: measured before (%s)", i + 1, len(self.cands), c.label,
                         self.rows[c.key]["status"])
                continue
            row = {"key": c.key, "label": c.label, "knobs": {f"{s}.{n}": v for (s, n), v in c.knobs.items()},
                   "settings": c.settings, "replicas": c.replicas, **self.measure(c)}
            log.info("[%d/%d] %s: %s %s", i + 1, len(self.cands), c.label, row["status"],
                     f"goodput {row['goodput_rps']:.2f} req/s" if row["status"] == "ok" else row.get("reason", ""))
            self.rows[c.key] = row
            with self.results_path.open("a") as f:
                f.write(json.dumps(row, default=str) + "\n")
        return [self.rows[c.key] for c in self.cands]

    def measure(self, c: Candidate) -> dict[str, Any]:
        for other in self.cands:
            row = self.rows.get(other.key)
            if row and row.get("oom") and larger_than_failed(c, other):
                return {"status": "skipped", "reason": f"needs more memory than {other.label}, which ran out"}
        out: dict[str, Any] = {}
        if c.changes_numerics(self.base):
            try:
                out["fidelity"] = self.gate.measure(c)
            except (KvyardError, ValueError) as e:
                return {"status": "infeasible", "reason": f"fidelity gate: {e}"}
            if out["fidelity"]["kl_mean"] > self.opts.kl_budget:
                return {**out, "status": "over_kl", "reason": f"KL {out['fidelity']['kl_mean']:.4f} over the "
                        f"budget {self.opts.kl_budget:g}"}
        runs = []
        for r in range(self.opts.repeats):
            run = self.run_once(c, r)
            if "error" in run:
                return {**out, "status": "infeasible", "reason": run["error"], "oom": run["oom"], "runs": runs}
            runs.append(run)
        goodputs = [run["goodput_rps"] for run in runs]
        return {**out, "status": "ok", "goodput_rps": statistics.median(goodputs), "runs": runs}

    def command(self, c: Candidate, config: Path) -> str:
        port = self.opts.port
        if c.settings.get("cluster"):
            args = ["up", "--config", str(config), "--router-port", str(port), "--worker-port", str(port + 1)]
        else:
            args = ["serve", "--config", str(config), "--port", str(port)]
        return shlex.join(kvyard_command(*args))

    def run_once(self, c: Candidate, repeat: int) -> dict[str, Any]:
        """One start of the deployment and one goodput search on it; {"error": ...} when it cannot serve."""
        config = self.opts.out / "candidates" / f"{c.key}.yaml"
        config.parent.mkdir(exist_ok=True)
        config.write_text(c.deployment_yaml())
        log_path = self.opts.out / "logs" / f"{c.key}-{repeat}.log"
        log_path.parent.mkdir(exist_ok=True)
        wait_port_free(self.opts.port)
        server = ManagedServer(self.command(c, config), self.opts.port, log_path)
        try:
            server.wait_ready(self.opts.ready_timeout)
            probes = replace(self.opts.search, url=server.url).run(seed=repeat)
            if server.proc.poll() is not None:
                raise BenchError(f"the server exited with status {server.proc.returncode} during the search")
        except BenchError as e:
            server.stop()
            why = _last_error(log_path)
            return {"error": f"{e}{': ' + why if why else ''}",
                    "oom": _ran_out_of_memory(server.proc.returncode, log_path)}
        server.stop()
        best = goodput_of(probes)
        return {"repeat": repeat, "goodput_rps": best.goodput_rps if best else 0.0,
                "at_rate": best.rate if best else None, "probes": [p.as_dict() for p in probes]}


def _last_error(log_path: Path) -> str:
    """The last line of the deployment's log that names an error (what a failed start says about itself)."""
    lines = log_path.read_text(errors="replace").splitlines()[-200:] if log_path.exists() else []
    errors = [line.strip() for line in lines if "error" in line.lower()]
    return errors[-1][:300] if errors else ""


def _ran_out_of_memory(returncode: int | None, log_path: Path) -> bool:
    """Killed by the kernel's OOM killer (SIGKILL) or an allocation failure in its log."""
    if returncode in (-9, 137):
        return True
    tail = log_path.read_text(errors="replace")[-4000:].lower() if log_path.exists() else ""
    return any(sign in tail for sign in OOM_SIGNS)


def best_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The candidate with the highest goodput (fewer replicas first among equals)."""
    ok = [r for r in rows if r["status"] == "ok" and r["goodput_rps"] > 0]
    return max(ok, key=lambda r: (r["goodput_rps"], -r["replicas"])) if ok else None
