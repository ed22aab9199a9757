"""How a finished run's results.json reads to a person: the reported metrics against its baseline
(the majority class, or a causal LM before fine-tuning), and the verdict (ft-train prints it at the
end)."""

from __future__ import annotations

from typing import Any


def format_results_table(results: dict[str, Any]) -> str:
    """A plain-text table of the reported metrics against the run's baseline, its forgetting, and its
    lm-eval benchmarks before and after."""
    reported = results[results["reported"]]
    baseline = results["baseline"]
    rows = [("split", "metric", "run", baseline["name"])]
    for split, metrics in reported["metrics"].items():
        base = baseline["metrics"].get(split, {})
        for name, value in metrics.items():
            rows.append((split, name, f"{value:.4f}", f"{base.get(name, float('nan')):.4f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    verdict = (f"FAILED (no better than the {baseline['name']})" if results["failed"]
               else f"ok (better than the {baseline['name']})")
    forgetting = reported.get("forgetting")
    if forgetting:
        lines.append("")
        lines.append("forgetting on the probe text (0 at θ*): " + ", ".join(
            f"{name} {value:.4f}" for name, value in forgetting.items()))
    lines.extend(_benchmark_lines(results))
    lines.append("")
    lines.append(f"{results['task']}: {results['reported']} at step {reported['step']} of {results['steps']}, "
                 f"{results['main_metric']} on {results['selection_split']}: {verdict}")
    return "\n".join(lines)


def _benchmark_lines(results: dict[str, Any]) -> list[str]:
    """The lm-eval benchmarks before (θ*) and after (the run), each score ± its stderr, the drop
    and their mean; none when the run scored none."""
    scores = results.get("benchmarks")
    if not scores:
        return []

    def shown(value: Any, stderr: Any) -> str:
        return f"{value:.4f}" + (f" ± {stderr:.4f}" if isinstance(stderr, (int, float)) else "")

    rows = [("benchmark", "metric", "θ* (before)", "run (after)", "drop")]
    for task, s in scores.items():
        rows.append((task, s["metric"], shown(s["theta_star"], s.get("theta_star_stderr")),
                     shown(s["score"], s.get("stderr")), f"{s['drop']:+.4f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["", *("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)]
    lines.insert(2, "  ".join("-" * w for w in widths))
    rates = [task for task, s in scores.items() if s.get("rate")]
    if results.get("benchmark_forgetting") is not None:
        lines.append(f"benchmark forgetting (the mean drop from θ* over the {len(rates)} task(s) scored by a rate: "
                     f"{', '.join(rates)}): {results['benchmark_forgetting']:+.4f}")
    else:
        lines.append("benchmark forgetting: none (no task is scored by a rate in [0, 1]; each drop is above)")
    return lines
