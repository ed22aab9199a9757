"""How a finished run's results.json reads to a person: the reported metrics against the
majority-class baseline, and the verdict (ft-train prints it at the end)."""

from __future__ import annotations

from typing import Any


def format_results_table(results: dict[str, Any]) -> str:
    """A plain-text table of the reported metrics against the majority-class baseline."""
    reported = results[results["reported"]]
    rows = [("split", "metric", "run", "majority baseline")]
    for split, metrics in reported["metrics"].items():
        base = results["majority_baseline"].get(split, {})
        for name, value in metrics.items():
            rows.append((split, name, f"{value:.4f}", f"{base.get(name, float('nan')):.4f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    verdict = "FAILED (at or below the majority baseline)" if results["failed"] else "ok (above the majority baseline)"
    lines.append("")
    lines.append(f"{results['task']}: {results['reported']} at step {reported['step']} of {results['steps']}, "
                 f"{results['main_metric']} on {results['selection_split']}: {verdict}")
    return "\n".join(lines)
