"""Checkpoint save/load time and peak memory per rank: the sharded layout against the formats
before it, on 2 ranks, for DeepSpeed ZeRO-2 + optimizer offload and FSDP2.

    python benchmarks/checkpoint_io.py                     # BERT-base size (~110 M parameters)
    python benchmarks/checkpoint_io.py --hidden 256 --layers 4   # ~11 M, a quick run
    python benchmarks/checkpoint_io.py --engines fsdp --checksums --repeats 5   # the checksums' cost

The driver launches `torchrun --nproc_per_node 2` once per engine; each rank builds the model
(a randomly initialized BertForSequenceClassification, theta* = its initial weights), takes one
RecAdam step so that every optimizer state exists (master, exp_avg, exp_avg_sq, anchor, step),
then for each format saves and loads into the live engine (same world size), a few times.

Formats:
- sharded: ft_framework.checkpointing (every rank writes its fragments through DCP; loads read
  only the overlapping saved chunks);
- ZeRO-2 before: a save wrote DeepSpeed's native checkpoint AND the consolidated file rank 0
  filled by gathering every parameter's master, moments and anchor (timed separately: the old save
  cost their sum); a same-size resume loaded the native one, a resume on another size the
  consolidated file (every rank reading all of it);
- FSDP2 before: torch.distributed.checkpoint of get_state_dict(model, optimizer).

Measured per rank: wall seconds (between barriers: the slowest rank), the resident set size (RSS)
just before the operation ("steady") and its peak during it (sampled every 2 ms from
/proc/self/statm), and peak / steady. Saves are fsync'ed by DCP (sync_files); torch.save (DeepSpeed,
consolidated) does not fsync. Output: a markdown table on stdout, JSON with --json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from ft_framework.distributed.rendezvous import free_port

HERE = Path(__file__).resolve().parent
ENGINES = ("zero2_offload", "fsdp")


# ---- per rank ------------------------------------------------------------------------------------
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples this process's RSS in a thread while the block runs."""

    def __init__(self, interval_s: float = 0.002):
        self.interval = interval_s
        self.peak = 0
        self._stop = threading.Event()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def __enter__(self):
        gc.collect()
        self.steady = rss_bytes()
        self.peak = self.steady
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def build_strategy(engine: str, hidden: int, layers: int):
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from ft_framework.optim import build_optimizer
    from ft_framework.optim.groups import build_param_groups

    world = int(os.environ["WORLD_SIZE"])
    if engine == "fsdp":
        from ft_framework.config import FSDPConfig
        from ft_framework.strategies.fsdp import FSDPStrategy

        strategy = FSDPStrategy(FSDPConfig(), SimpleNamespace(precision="fp32", device="cpu"))
    else:
        from ft_framework.config import DeepSpeedConfig, TrainingConfig
        from ft_framework.strategies.deepspeed import DeepSpeedStrategy

        strategy = DeepSpeedStrategy(DeepSpeedConfig(zero_stage=2, offload_optimizer=True),
                                     TrainingConfig(max_steps=1, per_device_batch_size=1, device="cpu",
                                                    max_grad_norm=None))
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                     intermediate_size=4 * hidden, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(cfg)
    anchors = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("classifier")}

    def make_optimizer(m):
        groups = build_param_groups(m, anchors, lr=1e-5, weight_decay=0.01, attach_anchors=False)
        return build_optimizer("recadam", groups, impl="torch", anneal_k=0.5, anneal_t0=10, pretrain_cof=1.0)

    strategy.setup(model, make_optimizer, anchors=anchors)
    del anchors
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(strategy.rank))
    out = strategy.forward({"input_ids": ids, "labels": torch.zeros(1, dtype=torch.long)})
    strategy.backward(out.loss)
    strategy.clip_and_step(None)
    return strategy, sum(p.numel() for p in model.parameters()) if engine != "fsdp" else None


# The formats before the sharded layout, as the strategies wrote them.
def old_native_save(strategy, directory: Path) -> None:
    strategy.engine.save_checkpoint(str(directory), tag="deepspeed", save_latest=False)


def old_consolidated_save(strategy, directory: Path) -> None:
    import torch

    master = strategy._adapter.MASTER
    params = {}
    for name, p in strategy.engine.module.named_parameters():
        entry = {"fp32": strategy.state_map.get_full(p, master)}
        for key in ("exp_avg", "exp_avg_sq", "anchor"):
            if strategy._partition_has(p, key):
                entry[key] = strategy.state_map.get_full(p, key)
        params[name] = entry
    if strategy.rank == 0:
        torch.save({"format": "ft_framework.consolidated_optimizer/1", "step": 1, "params": params},
                   directory / "consolidated_optimizer.pt")
    del params


def old_deepspeed_load(strategy, directory: Path) -> None:
    strategy.engine.load_checkpoint(str(directory), tag="deepspeed", load_optimizer_states=True,
                                    load_lr_scheduler_states=False)


def old_consolidated_load(strategy, directory: Path) -> None:
    import torch

    saved = torch.load(directory / "consolidated_optimizer.pt", map_location="cpu", weights_only=True)
    names = {n: p for n, p in strategy.engine.module.named_parameters()}
    for name, entry in saved["params"].items():
        for key, value in entry.items():
            strategy.state_map.set_full(names[name], strategy._adapter.MASTER if key == "fp32" else key, value)
    del saved


def old_fsdp_save(strategy, directory: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(strategy.model, strategy.optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, storage_writer=dcp.FileSystemWriter(str(directory)))


def old_fsdp_load(strategy, directory: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(strategy.model, strategy.optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(directory)))
    set_state_dict(strategy.model, strategy.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


def rank_main(args) -> None:
    from ft_framework.distributed import collectives
    from ft_framework.checkpointing.manifest import file_records, record_files

    strategy, numel = build_strategy(args.engine, args.hidden, args.layers)
    if args.engine == "fsdp":
        numel = sum(p.numel() for p in strategy.model.parameters())
    formats = {"sharded": (strategy.save_checkpoint, {"load": strategy.load_checkpoint})}
    if args.checksums:
        def checksums(d):
            # What CheckpointManager.save adds after the save: each rank checksums its share of
            # the files, rank 0 records them all in the manifest (timed on its own, after the save).
            parts = collectives.all_gather_object(file_records(d, strategy.rank, strategy.world_size))
            if strategy.rank == 0:
                record_files(d, {k: v for part in parts for k, v in part.items()})

        formats["sharded, then size/xxh3_64 into the manifest"] = (strategy.save_checkpoint, {"checksums": checksums})
    if args.engine == "fsdp":
        formats["before (DCP get_state_dict)"] = (lambda d: old_fsdp_save(strategy, d),
                                                  {"load": lambda d: old_fsdp_load(strategy, d)})
    else:
        # Before, a save wrote both; a same-size resume read the native one, any other the
        # consolidated file.
        formats["before: DeepSpeed native"] = (lambda d: old_native_save(strategy, d),
                                               {"load": lambda d: old_deepspeed_load(strategy, d)})
        formats["before: consolidated file"] = (lambda d: old_consolidated_save(strategy, d),
                                                {"load": lambda d: old_consolidated_load(strategy, d)})
    rows = []
    root = Path(args.workdir)
    for repeat in range(args.repeats):
        for index, (fmt, (save, loads)) in enumerate(formats.items()):
            directory = root / f"{args.engine}_{repeat}_{index}"
            if strategy.rank == 0:
                shutil.rmtree(directory, ignore_errors=True)
                directory.mkdir(parents=True)
            collectives.barrier()
            for op, fn in [("save", save), *loads.items()]:
                collectives.barrier()
                with PeakRSS() as mem:
                    t0 = time.perf_counter()
                    fn(directory)
                    collectives.barrier()
                    seconds = time.perf_counter() - t0
                rows.append({"format": fmt, "op": op, "repeat": repeat, "rank": strategy.rank, "seconds": seconds,
                             "steady": mem.steady, "peak": mem.peak})
            collectives.barrier()
            if strategy.rank == 0:
                size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
                rows.append({"format": fmt, "op": "disk", "bytes": size})
                shutil.rmtree(directory, ignore_errors=True)
    gathered = collectives.all_gather_object(rows)
    if strategy.rank == 0:
        with open("/proc/loadavg") as f:
            load = " ".join(f.read().split()[:3])
        Path(args.result).write_text(json.dumps({"engine": args.engine, "params": numel, "loadavg": load,
                                                 "rows": [r for rs in gathered for r in rs]}))
    strategy.close()


# ---- driver ----------------------------------------------------------------------------------------
def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def summarize(result: dict) -> list[list[object]]:
    """One row per (format, operation): median seconds (rank 0, between barriers: the slowest
    rank), and per rank the median steady RSS and the largest rise above it in any repeat."""
    rows = [r for r in result["rows"] if r["op"] != "disk"]
    disk = {r["format"]: r["bytes"] for r in result["rows"] if r["op"] == "disk"}
    keys: list[tuple[str, str]] = []
    for r in rows:
        if (r["format"], r["op"]) not in keys:
            keys.append((r["format"], r["op"]))
    table = []
    for fmt, op in keys:
        mine = [r for r in rows if (r["format"], r["op"]) == (fmt, op)]
        seconds = [r["seconds"] for r in mine if r["rank"] == 0]
        per_rank = []
        for rank in sorted({r["rank"] for r in mine}):
            rr = [r for r in mine if r["rank"] == rank]
            steady = statistics.median(r["steady"] for r in rr)
            rise = max(r["peak"] - r["steady"] for r in rr)
            ratio = max(r["peak"] / r["steady"] for r in rr)
            per_rank.append(f"{mib(steady)} +{mib(rise)} (×{ratio:.2f})")
        table.append([result["engine"], fmt, op, f"{statistics.median(seconds):.2f} ({min(seconds):.2f}–{max(seconds):.2f})",
                      *per_rank, mib(disk[fmt]) if op == "save" else ""])
    return table


def print_tables(results: list[dict], repeats: int) -> None:
    from harness import machine_line, markdown_table

    print(machine_line())
    for result in results:
        print(f"\n{result['engine']}: {result['params'] / 1e6:.1f} M parameters, 2 ranks, {repeats} repeats; "
              f"load average at the end: {result.get('loadavg', 'n/a')}\n")
        print(markdown_table(["engine", "format", "operation", "seconds, median (min–max)",
                              "rank 0 RSS: steady +largest rise (max peak/steady)", "rank 1 RSS: same", "on disk"],
                             summarize(result)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--workdir", default=None, help="where checkpoints are written (default: a temp dir)")
    parser.add_argument("--json", help="also write the measurements here")
    parser.add_argument("--from-json", help="print the tables of an earlier run's --json file; run nothing")
    parser.add_argument("--checksums", action="store_true", help="also time the sharded save with each file's "
                        "size and xxh3_64 checksum recorded in the manifest (what CheckpointManager.save does), paired with it")
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args)
        return 0
    import tempfile

    sys.path.insert(0, str(HERE))
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
        print_tables(results, repeats=max(r.get("repeat", 0) for res in results for r in res["rows"]) + 1)
        return 0

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ckpt_io_"))
    results = []
    for engine in args.engines:
        result_path = workdir / f"result_{engine}.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), __file__, "--rank-main", "--engine", engine, "--hidden", str(args.hidden),
               "--layers", str(args.layers), "--repeats", str(args.repeats), "--workdir", str(workdir),
               "--result", str(result_path)] + (["--checksums"] if args.checksums else [])
        print(f"running {engine} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print((proc.stdout + proc.stderr)[-5000:], file=sys.stderr)
            return 1
        results.append(json.loads(result_path.read_text()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print_tables(results, args.repeats)
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
