"""What `kvyard tune` leaves behind (#38): the best deployment as a file `kvyard serve --config` (or
`kvyard up --config`) runs, a table of every candidate, and the Pareto front of throughput per replica against
the speed each user sees.

Every passing probe of every candidate is a point: output tok/s over the deployment's replicas, against 1000 /
the median TPOT (how fast one stream reads). A point is on the front when no other point is at least as good
on both axes and better on one.
"""

import statistics
from pathlib import Path
from typing import Any

from kvyard.plan.tune_space import deployment_yaml


def points(rows: list[dict[str, Any]]) -> list[tuple[float, float, str]]:
    """(tok/s per user, tok/s per replica, label) of every passing probe."""
    return [(p["tok_s_per_user"], p["output_tok_s"] / r["replicas"], r["label"])
            for r in rows if r["status"] == "ok" for run in r["runs"] for p in run["probes"] if p["passed"]]


def pareto_front(pts: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    front = [p for p in pts if not any(q[0] >= p[0] and q[1] >= p[1] and q[:2] != p[:2] for q in pts)]
    return sorted(front)


def write_deployment(best: dict[str, Any], path: Path) -> None:
    head = (f"# kvyard tune: the best of the candidates measured ({best['label']}), goodput "
            f"{best['goodput_rps']:.2f} req/s\n")
    path.write_text(head + deployment_yaml(best["settings"]))


def _table_row(r: dict[str, Any], base_goodput: float) -> str:
    cells = [r["label"], r["status"], "", "", "", "", r.get("reason", "")]
    if r["status"] == "ok":
        cells[2] = f"{r['goodput_rps']:.2f}"
        cells[3] = f"{r['goodput_rps'] / base_goodput:.2f}x" if base_goodput else ""
        rates = [run["at_rate"] for run in r["runs"] if run.get("at_rate")]
        cells[4] = f"{statistics.median(rates):.2f}" if rates else ""
    if "fidelity" in r:
        cells[5] = f"{r['fidelity']['kl_mean']:.4f}"
    return "| " + " | ".join(cells) + " |"


def markdown(rows: list[dict[str, Any]], best: dict[str, Any] | None, workload: str) -> str:
    base_goodput = rows[0].get("goodput_rps", 0.0) if rows[0]["status"] == "ok" else 0.0
    lines = [f"# kvyard tune: {workload}", "",
             "| candidate | status | goodput req/s | vs default | at rate req/s | KL mean | reason |",
             "|---|---|---:|---:|---:|---:|---|",
             *(_table_row(r, base_goodput) for r in rows), "",
             f"Best: **{best['label']}** (deploy.yaml)" if best else "No candidate met the SLOs at any load."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = points(rows)
    fig, ax = plt.subplots(figsize=(7, 5))
    for label in dict.fromkeys(p[2] for p in pts):
        mine = [p for p in pts if p[2] == label]
        ax.scatter([p[0] for p in mine], [p[1] for p in mine], label=label, alpha=0.6)
    front = pareto_front(pts)
    ax.plot([p[0] for p in front], [p[1] for p in front], "k--", label="Pareto front")
    ax.set_xlabel("tok/s per user (1000 / median TPOT ms)")
    ax.set_ylabel("output tok/s per replica")
    ax.set_title("kvyard tune: probes that met the SLOs")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
