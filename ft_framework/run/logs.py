"""Per-run logs: OUTPUT_DIR/metrics.jsonl (one JSON record per line) and, optionally, TensorBoard."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ft_framework.run.files import METRICS_FILE, TENSORBOARD_DIR
from ft_framework.run.tracking import scalars_for_trackers


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """TensorBoard tags for the numbers in a record."""
    out = {}
    if record.get("type") == "eval":
        for split, metrics in record["metrics"].items():
            for name, value in metrics.items():
                out[f"eval/{split}/{name}"] = value
        for name, value in record.get("forgetting", {}).items():
            out[f"eval/forgetting/{name}"] = value
        return out
    for key, value in record.items():
        if key in ("type", "step"):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"train/{key}"] = value
        elif isinstance(value, list):
            for i, v in enumerate(value):
                if isinstance(v, (int, float)):
                    out[f"train/{key}/group_{i}"] = v
    return out


class MetricsLogger:
    def __init__(self, output_dir: Path, enabled: bool = True, tensorboard: bool = False, trackers=()):
        self.enabled = enabled
        # MLflow / W&B (ft_framework/tracking.py): every record goes to them too, same steps.
        self.trackers = list(trackers) if enabled else []
        self.path = Path(output_dir) / METRICS_FILE
        self.writer = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(log_dir=str(Path(output_dir) / TENSORBOARD_DIR))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record, allow_nan=True) + "\n")
        if self.writer is not None:
            for tag, value in _scalars(record).items():
                if math.isfinite(value):
                    self.writer.add_scalar(tag, value, record["step"])
            self.writer.flush()
        if self.trackers:
            values = scalars_for_trackers(_scalars(record))
            for tracker in self.trackers:
                tracker.log_metrics(values, record["step"])

    def log_artifact(self, path: Path) -> None:
        """Attaches a file (results.json) to every tracker's run."""
        for tracker in self.trackers if self.enabled else ():
            tracker.log_artifact(Path(path))

    def truncate_after(self, step: int) -> None:
        """Drops records past `step` (written by an attempt that did not reach its next checkpoint)."""
        if not self.enabled or not self.path.is_file():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.path)

    def close(self, ok: bool = True) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        for tracker in self.trackers:
            tracker.finish(ok)
        self.trackers = []
