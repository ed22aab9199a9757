"""The largest micro-batch per GPU size, from the memory plan (ft-plan's library), for docs/memory.md;
and the host and device bytes per parameter of an 8B decoder under our offload and the others.

    python benchmarks/memory_table.py > /tmp/table.md     # 10-30 minutes on 2 cores
    python benchmarks/memory_table.py BERT-large          # one model's rows
    python benchmarks/memory_table.py --bytes-per-param   # Llama-3.1-8B: ours, DeepSpeed, torchao

ALBERT-xxlarge and BERT-large (their published architectures, resources/architectures), bf16,
one rank, RecAdam; sequence length 128 and 512; single GPU, DeepSpeed ZeRO-2 with the optimizer
offloaded, our overlapped offload, FSDP2 (bf16 mixed precision); with and without activation
checkpointing. A cell is the largest per-device batch whose planned peak (CUDA context and
allocator slack included) fits the GPU; 0: not even batch 1. Planned only: no GPU measured them.

--bytes-per-param: Llama-3.1-8B's shipped architecture (8.03 B parameters), one GPU. Ours: the
plan's rows of configs/llama3_8b_sft_recadam.yaml (the device-lean offload, the compact state),
at gradient_accumulation_steps 1 and 16. DeepSpeed ZeRO-2/3 with the optimizer (and, for ZeRO-3,
the parameters) offloaded: DeepSpeed's own estimator (deepspeed.runtime.zero.stage3.
estimate_zero3_model_states_mem_needs, stage_1_and_2's estimate_zero2_...), called with the
model's parameter count and largest layer. DeepSpeed with bf16 master weights, gradients and
optimizer states (bf16_master_weights_and_grads + bf16_optimizer_states, its PR #8010) and
torchao's CPUOffloadOptimizer: no estimator; their bytes per tensor, written out below from the
PR's description and torchao's source.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ft_framework.config import validate_config
from ft_framework.strategies.memory_fit import largest_micro_batches, load_architecture, plan_run
from ft_framework.task_kinds import build_task_kind

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


LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
LLAMA_RECIPE = Path(__file__).resolve().parents[1] / "configs" / "llama3_8b_sft_recadam.yaml"


def bytes_per_param() -> None:
    """The table of docs/memory.md "Host bytes per parameter of an 8B decoder"."""
    import torch
    from transformers import AutoModelForCausalLM

    from ft_framework.config import load_config
    from ft_framework.strategies.memory_plan import plan_memory

    arch = load_architecture(run_config(LLAMA_8B, {"name": "single"}, 128, False).model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(arch.config)
    params = sum(p.numel() for p in model.parameters())
    # DeepSpeed's "largest layer": the most parameters one module holds directly (its model_to_params)
    largest_layer = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    rows = []
    for accumulation in (1, 16):
        cfg = load_config(LLAMA_RECIPE, ["training.per_device_batch_size=1",
                                         f"training.gradient_accumulation_steps={accumulation}"], check_paths=False)
        states = plan_memory(cfg, world_size=1, num_params=params, num_anchored=params)
        plan = plan_run(cfg, task=build_task_kind(cfg), world_size=1, on_gpu=True, arch=arch)
        rows.append([f"ours: device-lean offload, compact state, accumulation {accumulation} (ft-plan)",
                     _per(sum(r.cpu_bytes for r in states), params), _per(plan.host_peak, params),
                     _per(sum(r.device_bytes for r in states), params), "yes (bf16, with the fp32 delta)", "kept"])
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    for what, (cpu, gpu, *_) in (
            ("DeepSpeed ZeRO-3, parameters and optimizer offloaded, fp32 states (estimator)",
             estimate_zero3_model_states_mem_needs(params, largest_layer, cpu_offload=True, cpu_offload_params=True)),
            ("DeepSpeed ZeRO-3, optimizer offloaded, fp32 states (estimator)",
             estimate_zero3_model_states_mem_needs(params, largest_layer, cpu_offload=True, cpu_offload_params=False)),
            ("DeepSpeed ZeRO-2, optimizer offloaded, fp32 states (estimator)",
             estimate_zero2_model_states_mem_needs(params, cpu_offload=True))):
        rows.append([what, _per(cpu / 1.5, params), _per(cpu, params), _per(gpu, params), "no", "kept (fp32 master)"])
    # bf16 master weights and gradients with bf16 moments (PR #8010: "~6 bytes/param" of offloaded state,
    # "bf16 master + two bf16 moments"), the bf16 gradient partition and, with offload_param, the bf16
    # parameter partition: 2 + 2 + 6. No estimator knows it; DeepSpeed's own estimator puts 1.5x on its bytes.
    rows.append(["DeepSpeed ZeRO-3, parameters and optimizer offloaded, bf16 master, gradients and states "
                 "(PR #8010; from its description)", "10.00", "15.00 (x1.5 as the estimator)",
                 _per(4 * largest_layer, params), "no", "lost (bf16 master)"])
    # torchao.optim.CPUOffloadOptimizer (source): per parameter a pinned host copy of the parameter and of
    # its gradient (empty_like: the model's dtype) and the wrapped optimizer's state (AdamW: exp_avg,
    # exp_avg_sq, zeros_like the host copy). A bf16 model (the fp32 one, 32 GB, does not fit 24 GB):
    # 4 x 2 bytes on the host; the device keeps the bf16 parameters and, without offload_gradients
    # (which refuses accumulation), their gradients.
    rows.append(["torchao CPUOffloadOptimizer, bf16 model, AdamW (from its source)", "8.00", "8.00", "2.00 (4.00 "
                 "without offload_gradients)", "no", "lost (bf16 master)"])
    print(f"Llama-3.1-8B ({params:,} parameters; largest layer {largest_layer:,}), one GPU: bytes per parameter")
    print()
    print("| setup | host, model states | host, with buffers | device, model states | theta* | an update below "
          "a bf16 ulp |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def _per(nbytes: float, params: int) -> str:
    return f"{nbytes / params:.2f}"


def main() -> None:
    if sys.argv[1:] == ["--bytes-per-param"]:
        bytes_per_param()
        return
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
                    cells = [str(b) for b in largest_micro_batches(cfg, task=build_task_kind(cfg), budgets_bytes=[gb * 1e9 for gb in GPUS_GB],
                                                                      world_size=1, on_gpu=True, arch=arch)]
                    print("| " + " | ".join([label, str(seq_len), name, "yes" if checkpointing else "no"] + cells) + " |",
                          flush=True)
    print("\nplanned only: no GPU has measured these rows", file=sys.stderr)


if __name__ == "__main__":
    main()
