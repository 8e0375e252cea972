"""The fidelity report of `kvyard quantize`: Markdown, JSON, and a PNG of per-layer sensitivity."""

import json
from pathlib import Path
from typing import Any

from kvyard.quant.tool import QuantizeResult, plan_record


def report_dict(r: QuantizeResult) -> dict[str, Any]:
    total = sum(u.params for u in r.units)
    out: dict[str, Any] = {
        "scheme": r.request.scheme,
        "weight_format": r.request.weight.name,
        "head_format": r.request.head.name if r.request.head else None,
        "rounding": r.rounding,
        "outlier_columns": r.outlier_columns,
        "fidelity": r.fidelity.as_dict(),
        "quantized_units": len(r.chosen),
        "candidate_units": len(r.units),
        "quantized_params": r.quantized_params,
        "candidate_params": total,
        "tool_call_valid_json": r.tool_json,
        "plan": plan_record(r)["units"],
    }
    for label, s in (("naive", r.naive), ("searched", r.searched)):
        if s is not None:
            out[label] = {"units": len(s.chosen), "params": s.params,
                          "kl_mean": s.fidelity.kl_mean if s.fidelity else None}
    return out


def report_markdown(r: QuantizeResult) -> str:
    f = r.fidelity
    lines = [
        f"# Quantization report: {r.request.scheme} ({r.request.weight.name})",
        "",
        "| figure | value |",
        "|---|---|",
        f"| KL(p_full ‖ p_quant) per token, mean | {f.kl_mean:.3g} |",
        f"| KL per token, p99 | {f.kl_p99:.3g} |",
        f"| top-1 agreement | {f.top1_agreement:.4f} |",
        f"| perplexity full → quant | {f.ppl_full:.3f} → {f.ppl_quant:.3f} ({f.ppl_change:+.2%}) |",
        f"| calibration tokens | {f.tokens} |",
        f"| rounding | {r.rounding}" + (" (its Hessians come from these same tokens: the KL above is in-sample)"
                                        if r.rounding == "gptq" else "") + " |",
        *([f"| LM head | {r.request.head.name} |"] if r.request.head else []),
        *([f"| outlier columns kept in full precision | {r.outlier_columns:.1%} of each layer's inputs |"]
          if r.outlier_columns else []),
        f"| layers quantized | {len(r.chosen)} of {len(r.units)} candidates |",
        f"| parameters quantized | {r.quantized_params:,} of {sum(u.params for u in r.units):,} |",
    ]
    if r.tool_json:
        lines.append(f"| valid tool-call JSON, full → quant | {r.tool_json['full']:.0%} → {r.tool_json['quant']:.0%} |")
    if r.naive and r.searched:
        lines += [
            "",
            "| plan | layers | parameters | joint KL |",
            "|---|---|---|---|",
            *(f"| {label} | {len(s.chosen)} | {s.params:,} | {s.fidelity.kl_mean if s.fidelity else float('nan'):.3g} |"
              for label, s in (("naive (by sensitivity, stop at budget)", r.naive),
                               ("searched (joint re-measure, skip misses)", r.searched))),
        ]
    return "\n".join(lines) + "\n"


def plot_sensitivity(r: QuantizeResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [u.name for u in r.units if u.name in r.sensitivity]
    kls = [max(r.sensitivity[n].kl_mean, 1e-9) for n in names]
    chosen = set(r.chosen)
    fig, ax = plt.subplots(figsize=(max(8, len(names) * 0.12), 4))
    ax.bar(range(len(names)), kls, color=["tab:blue" if n in chosen else "tab:gray" for n in names])
    ax.set_yscale("log")
    ax.set_ylabel("KL when quantized alone")
    ax.set_title(f"Per-layer sensitivity, {r.request.weight.name} (blue: quantized)")
    step = max(1, len(names) // 40)
    ax.set_xticks(range(0, len(names), step))
    ax.set_xticklabels([n.replace("model.layers.", "L") for n in names[::step]], rotation=90, fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(r: QuantizeResult, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "quant_report.md", out / "quant_report.json"]
    paths[0].write_text(report_markdown(r))
    paths[1].write_text(json.dumps(report_dict(r), indent=2))
    if r.sensitivity:
        paths.append(out / "sensitivity.png")
        plot_sensitivity(r, paths[-1])
    return paths
