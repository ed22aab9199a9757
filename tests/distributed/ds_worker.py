"""The DeepSpeed cases of tests/distributed/test_deepspeed.py, as steps of rank_launcher's plan
(tests/distributed/rank_launcher.py: the ranks of each step forked from this one process, a launch
costs far more than a case); each writes what the test compares to OUT/<case>.pt.

    python ds_worker.py PLAN
Steps: "main" (2 ranks: every stage, resume, save for resharding), "reshard" (load a checkpoint of
another number of ranks, continue; the test runs it on 1 rank from the 2-rank one, saving a 1-rank
one, then on 2 ranks from that).
"""

import dataclasses
import os
import pickle
import shutil
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from ft_framework.strategies import deepspeed_adapter  # noqa: E402,F401  (imports deepspeed without mlflow)
from deepspeed.accelerator import get_accelerator  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from ds_common import (ACCUM_CASES, CASES, CHECKPOINTING_CASES, HPARAMS, LR, accumulation,  # noqa: E402
                       batches_for_rank, ds_configs, make_model_and_anchors)
from ft_framework.models.activation_checkpointing import (apply_activation_checkpointing,  # noqa: E402
                                                          checkpointed_blocks)
from ft_framework.models.loading import apply_mixout  # noqa: E402
from ft_framework.optim import build_optimizer  # noqa: E402
from ft_framework.optim.groups import build_param_groups  # noqa: E402
from ft_framework.strategies.deepspeed import DeepSpeedStrategy  # noqa: E402
from rank_launcher import preimport_deepspeed_initialize, run_plan  # noqa: E402


def make_strategy(case: str, checkpointing: bool | None = None):
    """`checkpointing` not None: dropout and Mixout on, activation checkpointing on or off."""
    ds_cfg, training_cfg = ds_configs(case, world_size=int(os.environ["WORLD_SIZE"]))
    strategy = DeepSpeedStrategy(ds_cfg, training_cfg)
    model, anchors = make_model_and_anchors(dropout=0.0 if checkpointing is None else 0.1)
    if checkpointing is not None:
        apply_mixout(model, 0.3, anchors)
    if checkpointing:
        apply_activation_checkpointing(model)

    def make_optimizer(m):
        # Split into anchored and new groups, but theta* goes to setup: placed after wrapping.
        groups = build_param_groups(m, anchors, lr=LR, weight_decay=0.01, attach_anchors=False)
        return build_optimizer("recadam", groups, impl="auto", **HPARAMS)

    strategy.setup(model, make_optimizer, anchors=anchors)
    return strategy, anchors


def train(strategy, steps: range, accum: int = 1):
    """Like the trainer: `accum` micro-batches per step, each loss divided by accum."""
    rank, world = strategy.rank, strategy.world_size
    for step in steps:
        batch = batches_for_rank(step, rank, world)
        for micro in range(accum):
            part = {k: v[micro::accum] for k, v in batch.items()}
            out = strategy.forward(part)
            strategy.backward(out.loss / accum, last_micro_batch=micro == accum - 1)
        strategy.clip_and_step(None)


def snapshot(strategy) -> dict:
    """Everything the test compares, gathered (collective), kept on rank 0."""
    result = {
        "masters": strategy.gather_full_state("fp32"),
        "anchors": strategy.gather_full_state("anchor"),
        "exp_avg": strategy.gather_full_state("exp_avg"),
        "anchor_numel_per_rank": strategy.gather_objects(strategy.anchor_numel_on_this_rank()),
        "forgetting_distance": strategy.forgetting_distance(),
        "impl": strategy.optimizer.impl,
        # What the step actually ran on: the kernel's counter, and the device/dtype of the fp32
        # partitions the optimizer received (under offload DeepSpeed hands it CPU copies).
        "kernel_calls": strategy.gather_objects(cpu_kernel_calls()),
        "partition_devices": sorted({flat.device.type for _, flat in strategy.state_map.partitions()}),
        "accelerator": get_accelerator().device_name(),
        "steps": strategy.optimizer.group_steps(),
    }
    return result


def save(strategy, path: Path, obj) -> None:
    if strategy.is_main_process:
        torch.save(obj, path)


_KERNEL_CALLS = [0]


def count_kernel_calls() -> None:
    """Counts the C++ kernel's fused steps in this process, so a test can tell which path ran."""
    from ft_framework.optim import cpu

    real = cpu._kernel

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

        def fused_step(self, *args, **kwargs):
            _KERNEL_CALLS[0] += 1
            return real.fused_step(*args, **kwargs)

        def _fused_step_many(self, *args, **kwargs):  # the optimizer's step: one call per coefficient set
            _KERNEL_CALLS[0] += 1
            return real._fused_step_many(*args, **kwargs)

    cpu._kernel = Counting()


def cpu_kernel_calls() -> int:
    calls, _KERNEL_CALLS[0] = _KERNEL_CALLS[0], 0
    return calls


def checkpointing_phase(out: Path) -> None:
    """The same 3 steps (dropout and Mixout on) with and without activation checkpointing."""
    for case in CHECKPOINTING_CASES:
        for checkpointing in (False, True):
            strategy, _ = make_strategy(case, checkpointing)
            calls = []
            inner = strategy.unwrapped_model().albert.encoder.albert_layer_groups[0].albert_layers[0].ffn
            inner.register_forward_hook(lambda *_: calls.append(1))
            for step in range(3):
                torch.manual_seed(100 * strategy.rank + step)  # other masks on each rank
                batch = batches_for_rank(step, strategy.rank, strategy.world_size)
                strategy.backward(strategy.forward(batch).loss)
                strategy.clip_and_step(None)
            tag = "checkpointed" if checkpointing else "plain"
            save(strategy, out / f"checkpointing_{case}_{tag}.pt",
                 {"masters": strategy.gather_full_state("fp32"), "inner_calls": len(calls),
                  "blocks": len(checkpointed_blocks(strategy.unwrapped_model()))})


def main_phase(out: str) -> None:
    out = Path(out)
    checkpointing_phase(out)
    for case in ACCUM_CASES:
        strategy, _ = make_strategy(case)
        train(strategy, range(5), accumulation(case))
        save(strategy, out / f"{case}.pt", snapshot(strategy))
    for case in CASES:
        # 3 steps, checkpoint, 2 more steps; then resume: a fresh engine loads the checkpoint and
        # takes the same 2 steps.
        strategy, _ = make_strategy(case)
        train(strategy, range(3))
        ckpt = out / f"ckpt_{case}"
        if strategy.is_main_process:
            ckpt.mkdir(exist_ok=True)
        strategy.barrier()
        strategy.save_checkpoint(ckpt)
        train(strategy, range(3, 5))
        save(strategy, out / f"{case}.pt", snapshot(strategy))
        second, _ = make_strategy(case)
        second.load_checkpoint(ckpt)
        train(second, range(3, 5))
        save(second, out / f"{case}_resumed.pt", snapshot(second))
    # Corrupted checkpoints: ckpt_zero2 with the anchor of one parameter left out of / mis-sized in
    # DCP's .metadata; every rank refuses it before reading anything.
    strategy, _ = make_strategy("zero2")
    errors = {}
    key = "param/albert.embeddings.word_embeddings.weight/anchor"
    for label, edit in (("missing", lambda md: md.pop(key)),
                        ("misshaped", lambda md: md.__setitem__(key, dataclasses.replace(md[key], size=torch.Size([9]))))):
        path = out / f"broken_{label}"
        if strategy.is_main_process:
            shutil.copytree(out / "ckpt_zero2", path)
            metadata = pickle.loads((path / ".metadata").read_bytes())
            edit(metadata.state_dict_metadata)
            (path / ".metadata").write_bytes(pickle.dumps(metadata))
        strategy.barrier()
        try:
            strategy.load_checkpoint(path)
            errors[label] = "no error"
        except (ValueError, RuntimeError) as exc:
            errors[label] = str(exc)
    # DeepSpeed clips inside engine.step() at its configured gradient_clipping (0 here): another
    # value is refused before anything steps.
    try:
        strategy.clip_and_step(1.0)
        errors["clip"] = "no error"
    except ValueError as exc:
        errors["clip"] = str(exc)
    save(strategy, out / "corrupted.pt", errors)


def reshard_phase(out: str, load_from: str, save_to: str | None) -> None:
    out = Path(out)
    for case in ("zero2", "zero3"):
        strategy, _ = make_strategy(case)
        strategy.load_checkpoint(out / f"{load_from}_{case}")
        save(strategy, out / f"loaded_{load_from}_{case}.pt", snapshot(strategy))
        if save_to:
            ckpt = out / f"{save_to}_{case}"
            if strategy.is_main_process:
                ckpt.mkdir(exist_ok=True)
            strategy.barrier()
            strategy.save_checkpoint(ckpt)
        train(strategy, range(3, 5))  # the checkpoint was taken after step 3
        save(strategy, out / f"continued_{load_from}_{case}.pt", snapshot(strategy))


if __name__ == "__main__":
    count_kernel_calls()
    preimport_deepspeed_initialize()
    run_plan({"main": main_phase, "reshard": reshard_phase})
