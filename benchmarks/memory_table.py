"""The largest micro-batch per GPU size, from the memory plan (ft-plan's library), for docs/memory.md.

    python benchmarks/memory_table.py > /tmp/table.md     # 10-30 minutes on 2 cores
    python benchmarks/memory_table.py BERT-large          # one model's rows

ALBERT-xxlarge and BERT-large (their published architectures, resources/architectures), bf16,
one rank, RecAdam; sequence length 128 and 512; single GPU, DeepSpeed ZeRO-2 with the optimizer
offloaded, our overlapped offload, FSDP2 (bf16 mixed precision); with and without activation
checkpointing. A cell is the largest per-device batch whose planned peak (CUDA context and
allocator slack included) fits the GPU; 0: not even batch 1. Planned only: no GPU measured them.
"""

from __future__ import annotations

import sys

from ft_framework.config import validate_config
from ft_framework.strategies.memory_fit import largest_micro_batches, load_architecture

GPUS_GB = (16, 24, 40, 80)
MODELS = {"ALBERT-xxlarge": "albert/albert-xxlarge-v2", "BERT-large": "google-bert/bert-large-uncased"}
STRATEGIES = {
    "single": {"name": "single"},
    "ZeRO-2 offload": {"name": "deepspeed", "deepspeed": {"zero_stage": 2, "offload_optimizer": True}},
    "overlapped offload": {"name": "single", "offload_optimizer": {"overlap": True}},
    "FSDP2": {"name": "fsdp", "fsdp": {"mixed_precision": True}},
}


def run_config(model: str, strategy: dict, seq_len: int, checkpointing: bool):
    return validate_config({
        "model": {"name_or_path": model}, "data": {"task": "rte", "max_seq_length": seq_len},
        "optimizer": {"name": "recadam", "hparams": {"lr": 2e-5}}, "schedule": {"warmup_steps": 0},
        "training": {"max_steps": 1, "per_device_batch_size": 1, "precision": "bf16", "device": "cuda",
                     "activation_checkpointing": checkpointing},
        "strategy": strategy})


def main() -> None:
    only = sys.argv[1] if len(sys.argv) > 1 else ""  # a model's label (the rows of one model)
    header = ["model", "seq", "strategy", "checkpointing"] + [f"{gb} GB" for gb in GPUS_GB]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for label, model in MODELS.items():
        if only and only != label:
            continue
        arch = load_architecture(run_config(model, {"name": "single"}, 128, False).model)
        for seq_len in (128, 512):
            for name, strategy in STRATEGIES.items():
                for checkpointing in (False, True):
                    cfg = run_config(model, strategy, seq_len, checkpointing)
                    cells = [str(b) for b in largest_micro_batches(cfg, budgets_bytes=[gb * 1e9 for gb in GPUS_GB],
                                                                      world_size=1, on_gpu=True, arch=arch)]
                    print("| " + " | ".join([label, str(seq_len), name, "yes" if checkpointing else "no"] + cells) + " |",
                          flush=True)
    print("\nplanned only: no GPU has measured these rows", file=sys.stderr)


if __name__ == "__main__":
    main()
