"""The 2 CPU ranks of tests/examples/test_hf_trainer_deepspeed.py, forked from this one process
(tests/distributed/rank_launcher.py: torch, transformers, DeepSpeed and the example imported once):

    python hf_deepspeed_worker.py PLAN     (one step, "train_and_resume", with out=OUT_DIR)

examples/hf_trainer_deepspeed.py trains 4 steps (checkpoint at 2), then a second Trainer resumes
from checkpoint-2. Each rank checks its own partitions against an independent load of the
pretrained weights; rank 0 writes what it found to <out>/worker.json and the final fp32 master
weights to <out>/masters_<run>.pt."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS.parent / "examples"))
sys.path.insert(0, str(TESTS / "distributed"))
import hf_trainer_deepspeed as example  # noqa: E402  (sets DS_ACCELERATOR before deepspeed is imported)
from _quickstart import MODEL, load_model, resolve_model_path  # noqa: E402
from rank_launcher import preimport_deepspeed_initialize, preimport_model_module, run_plan  # noqa: E402

from ft_framework.optim import cpu as cpu_kernel  # noqa: E402
from ft_framework.strategies import deepspeed_adapter  # noqa: E402
from ft_framework.strategies.deepspeed_adapter import MASTER  # noqa: E402


def inspect(trainer, pretrained: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """What ran and what each anchored partition holds (collective: every rank calls it)."""
    factory = trainer.optimizer_cls_and_kwargs[0]
    engine, ours = trainer.model_wrapped, factory.optimizer
    named = list(engine.module.named_parameters())
    state_map = deepspeed_adapter.state_map_for(engine, ours, [p for _, p in named])
    anchored_groups = {g["group_name"]: g["anchored"] for g in ours.param_groups}
    anchor_mismatches, masters = [], {}
    for name, p in named:
        masters[name] = state_map.get_full(p, MASTER)
        if name in factory.anchored_names:
            if not torch.equal(state_map.get_full(p, "anchor"), pretrained[name]):
                anchor_mismatches.append(name)
    # ||theta - theta*|| from the gathered masters, in fp64: the reference for the optimizer's own.
    reference = math.sqrt(sum(float(((masters[n].double() - pretrained[n].double()) ** 2).sum())
                              for n in factory.anchored_names))
    unanchored_flats_with_anchor = sum("anchor" in ours.state.get(p, {})
                                       for g in ours.param_groups if not g["anchored"] for p in g["params"])
    return {
        "zero_optimizer": type(engine.optimizer).__name__,
        "base_optimizer_is_ours": engine.optimizer.optimizer is ours,
        "optimizer": type(ours).__name__, "impl": ours.impl, "kernel_available": cpu_kernel.kernel_available(),
        "cpu_offload": bool(getattr(engine.optimizer, "cpu_offload", False)),
        "anchored_names": factory.anchored_names, "anchored_groups": anchored_groups,
        "unanchored_partitions_with_anchor": unanchored_flats_with_anchor,
        "anchor_mismatches": anchor_mismatches, "theta_star_source": factory.theta_star_source,
        "pending_theta_star_dropped": factory.pending_theta_star is None,
        "forgetting_distance": ours.forgetting_distance(all_reduce=True), "reference_distance": reference,
        "moved": sum(not torch.equal(masters[n], pretrained[n]) for n in factory.anchored_names),
        "global_step": trainer.state.global_step,
        "logs": [h for h in trainer.state.log_history if "loss" in h],
    }, masters


def train_and_resume(out: str) -> None:
    out = Path(out)
    torch.manual_seed(0)
    reference, _, _ = load_model()  # an independent load of the same pretrained weights
    pretrained = {n: p.detach().clone() for n, p in reference.named_parameters()}
    common = dict(train_examples=32, extra_args={"per_device_train_batch_size": 4})
    first = example.build_deepspeed_trainer(str(out / "run"), max_steps=4, save_steps=2, **common)
    first.train()
    found_first, masters_first = inspect(first, pretrained)
    found = {"first": found_first}
    resumed = example.build_deepspeed_trainer(str(out / "run"), max_steps=4, save_steps=2, **common)
    resumed.train(resume_from_checkpoint=str(out / "run" / "checkpoint-2"))
    found["resumed"], masters_resumed = inspect(resumed, pretrained)
    if first.is_world_process_zero():
        (out / "worker.json").write_text(json.dumps(found, indent=1))
        torch.save(masters_first, out / "masters_first.pt")
        torch.save(masters_resumed, out / "masters_resumed.pt")


if __name__ == "__main__":
    preimport_deepspeed_initialize()
    preimport_model_module(resolve_model_path(MODEL))
    run_plan({"train_and_resume": train_and_resume})
