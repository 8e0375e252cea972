"""PNG plots of a `kvyard bench serve` report: latency percentiles, and throughput over a sweep.

matplotlib is imported here only, with the Agg backend, so the benchmark itself needs no display and
the rest of kvyard does not depend on matplotlib.
"""

from pathlib import Path
from typing import Any

_METRICS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def _run_label(run: dict[str, Any]) -> str:
    load = run["load"]
    if load["mode"] == "closed":
        return f"concurrency {load['concurrency']}"
    rate = load["request_rate"]
    return f"Poisson {rate:g} req/s" if rate is not None else "all at once"


def _latency_bars(ax: Any, summary: dict[str, Any], percentiles: list[float], title: str) -> None:
    keys = [f"p{p:g}" for p in percentiles]
    metrics = [(k, name) for k, name in _METRICS if summary.get(k)]
    width = 0.8 / len(keys)
    for j, key in enumerate(keys):
        xs = [i + (j - (len(keys) - 1) / 2) * width for i in range(len(metrics))]
        ax.bar(xs, [summary[k][key] for k, _ in metrics], width, label=key)
    ax.set_xticks(range(len(metrics)), [name for _, name in metrics])
    ax.set_yscale("log")  # TTFT/E2E are often 10-100x ITL/TPOT
    ax.set_ylabel("ms (log scale)")
    ax.set_title(title)
    ax.legend()
    ax.grid(axis="y", which="both", alpha=0.3)


def _concurrency_axis(ax: Any, conc: list[int]) -> None:
    ax.set_xscale("log", base=2)  # sweeps double the concurrency; ticks at the levels measured
    ax.set_xticks(conc, [str(c) for c in conc])
    ax.minorticks_off()


def _sweep(ax_tput: Any, ax_lat: Any, runs: list[dict[str, Any]], percentiles: list[float]) -> None:
    conc = [r["load"]["concurrency"] for r in runs]
    ax_tput.plot(conc, [r["summary"]["output_throughput"] for r in runs], "o-", label="output tok/s")
    ax_tput.set_xlabel("concurrency")
    ax_tput.set_ylabel("output tokens/s")
    _concurrency_axis(ax_tput, conc)
    ax_tput.set_title("throughput vs concurrency")
    ax_tput.grid(alpha=0.3)
    req = ax_tput.twinx()
    req.plot(conc, [r["summary"]["request_throughput"] for r in runs], "s--", color="tab:gray", label="req/s")
    req.set_ylabel("requests/s")
    lines = ax_tput.get_lines() + req.get_lines()
    ax_tput.legend(lines, [line.get_label() for line in lines], loc="upper left")
    for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL")):
        for p in (percentiles[0], percentiles[-1]):
            ys = [(r["summary"].get(key) or {}).get(f"p{p:g}") for r in runs]
            ax_lat.plot(conc, ys, "o-", label=f"{name} p{p:g}")
    ax_lat.set_xlabel("concurrency")
    _concurrency_axis(ax_lat, conc)
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("ms (log scale)")
    ax_lat.set_title("latency vs concurrency")
    ax_lat.legend()
    ax_lat.grid(which="both", alpha=0.3)


def plot_report(report: dict[str, Any], path: str | Path) -> Path:
    """Write a PNG: latency bars of each run; with several closed-loop runs, the sweep curves too."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    percentiles = report["percentiles"]
    sweep = len(runs) > 1 and all(r["load"]["mode"] == "closed" for r in runs)
    shown = [runs[0], runs[-1]] if sweep else runs[-1:]  # the sweep's extremes; else the run itself
    nrows = 2 if sweep else 1  # a sweep: the extremes' latency bars on top, its curves below
    fig, axes = plt.subplots(nrows, len(shown), figsize=(6.5 * len(shown), 4.5 * nrows), squeeze=False)
    for ax, run in zip(axes[0], shown, strict=True):
        _latency_bars(ax, run["summary"], percentiles, f"latency, {_run_label(run)}")
    if sweep:
        _sweep(axes[1][0], axes[1][1], runs, percentiles)
    wl = report["workload"]
    fig.suptitle(f"{report['model']} — {wl['name']}, in ~{wl['input_len']} / out {wl['output_len']} tokens, "
                 f"{wl['requests']} requests")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    return out
