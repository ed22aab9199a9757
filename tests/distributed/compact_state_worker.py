"""The worker of test_compact_state_distributed.py: `compact_state_worker.py PLAN` does the steps of
rank_launcher's plan one after another, each on ranks of its own forked from this process. A step
is a trainer run (rank_launcher.fit_step) or

    step("pieces", out=DIR)  FSDP2 steps of the compact state on a few parameters with given
                             gradients; each rank writes its local pieces
    step("zero", out=DIR)    the same steps under DeepSpeed ZeRO 0-2 (DS_ACCELERATOR=cpu);
                             rank 0 writes the gathered state
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from rank_launcher import close, run_plan

SEED = 97
STEPS = 3
# Rows that torch.chunk splits unevenly over 2 ranks: 4 + 3, 2 + 1, and 1 + 0 (rank 1 holds nothing).
SHAPES = {"a": (7, 5), "b": (3,), "c": (1, 4), "head": (5, 2)}
ANCHORED = ("a", "b", "c")
HPARAMS = dict(lr=1e-2, weight_decay=0.01, anneal_k=0.5, anneal_t0=2, pretrain_cof=5.0)


def parameters() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {name: torch.randn(shape, generator=gen) * 0.1 for name, shape in SHAPES.items()}


def pretrained(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: params[name] + 0.01 for name in ANCHORED}


def gradients() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(4)
    return [{name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()} for _ in range(STEPS)]


def groups(named: dict[str, torch.Tensor]) -> list[dict]:
    return [{"params": [named[n] for n in ANCHORED], "anchored": True, "param_names": list(ANCHORED)},
            {"params": [named["head"]], "param_names": ["head"]}]


class Pieces(nn.Module):
    def __init__(self):
        super().__init__()
        for name, value in parameters().items():
            self.register_parameter(name, nn.Parameter(value.clone()))

    def forward(self, **targets: torch.Tensor) -> SimpleNamespace:
        """A loss whose gradient is `targets`, exactly: every rank passes the same, so ZeRO's
        average over 2 ranks ((g + g) / 2) is g again, bit for bit."""
        return SimpleNamespace(loss=sum((getattr(self, name) * t).sum() for name, t in targets.items()))


def pieces(out: str) -> None:
    """Per variant (impl, FSDP2's cpu_offload): each step's local pieces of every parameter and its
    state, and the index base each rank's optimizer rounds them with."""
    from torch.distributed.tensor import distribute_tensor

    from ft_framework.config.schema import FSDPConfig
    from ft_framework.optim import build_optimizer
    from ft_framework.optim import cpu as cpu_kernel
    from ft_framework.strategies.fsdp import FSDPStrategy

    impls = ["torch"] + (["cpu"] if cpu_kernel.kernel_available() else [])
    results, strategies = {}, []
    for impl in impls:
        for offload in (False, True):
            strategy = FSDPStrategy(FSDPConfig(cpu_offload=offload))
            strategies.append(strategy)
            model, opt = strategy.setup(
                Pieces(), lambda m: build_optimizer("recadam", groups(dict(m.named_parameters())), impl=impl,
                                                    state_dtype="bfloat16", anchor_dtype="bfloat16",
                                                    rounding_seed=SEED, **HPARAMS),
                anchors=pretrained(parameters()))
            named = dict(model.named_parameters())
            record = {}
            for step, grads in enumerate(gradients(), start=1):
                for name, p in named.items():
                    p.grad = distribute_tensor(grads[name], p.device_mesh, p.placements, src_data_rank=None)
                strategy.clip_and_step(None)
                for name, p in named.items():
                    state = opt.state[p]
                    record[(step, name)] = {
                        "index_base": opt.index_base(p), "param": p.to_local().detach().clone(),
                        **{k: state[k].to_local().clone() for k in ("exp_avg", "exp_avg_sq", "delta", "anchor")
                           if k in state}}
            results[(impl, offload)] = record
    # An optimizer on the shards that nobody told their offsets refuses to number them.
    unnumbered = build_optimizer("recadam", groups(named), impl="torch", state_dtype="bfloat16",
                                 anchor_dtype="bfloat16", rounding_seed=SEED, **HPARAMS)
    try:
        unnumbered.index_base(named["a"])
        results["unnumbered"] = None
    except ValueError as exc:
        results["unnumbered"] = str(exc)
    torch.save(results, Path(out) / f"pieces_rank{strategy.rank}.pt")
    close(strategies)


# (ZeRO stage, offload_optimizer, impl) of the zero mode: every stage, each impl twice (the
# numbering does not depend on the impl; unit tests hold the impls equal bit for bit). "cpu" runs
# the torch path where the kernel is not built.
ZERO_VARIANTS = ((0, False, "torch"), (1, False, "cpu"), (2, False, "torch"), (2, True, "cpu"))


def zero(out: str) -> None:
    """Per (impl, stage, offload) of ZERO_VARIANTS: each step's full master, moments and theta* of every parameter,
    gathered from the ZeRO partitions (the strategy's gather_full_state), and each partition's
    index base on each rank."""
    from ft_framework.config.schema import DeepSpeedConfig, TrainingConfig
    from ft_framework.optim import build_optimizer
    from ft_framework.optim import cpu as cpu_kernel
    from ft_framework.strategies.deepspeed import DeepSpeedStrategy

    results, strategies = {}, []
    for stage, offload, wanted in ZERO_VARIANTS:
        impl = wanted if wanted == "torch" or cpu_kernel.kernel_available() else "torch"
        strategy = DeepSpeedStrategy(DeepSpeedConfig(zero_stage=stage, offload_optimizer=offload),
                                     TrainingConfig(max_steps=STEPS, per_device_batch_size=1, device="cpu",
                                                    max_grad_norm=None))
        strategies.append(strategy)
        model, opt = strategy.setup(
            Pieces(), lambda m: build_optimizer("recadam", groups(dict(m.named_parameters())), impl=impl,
                                                state_dtype="bfloat16", anchor_dtype="bfloat16",
                                                rounding_seed=SEED, **HPARAMS),
            anchors=pretrained(parameters()))
        record = {"index_bases": strategy.gather_objects([b for _, b in strategy.state_map.index_bases()]),
                  "deltas": strategy.gather_objects(sum("delta" in s for s in opt.state.values()))}
        for step, grads in enumerate(gradients(), start=1):
            strategy.backward(strategy.forward(grads).loss)
            strategy.clip_and_step(None)
            record[step] = {key: strategy.gather_full_state(key) for key in ("fp32", "exp_avg", "exp_avg_sq",
                                                                             "anchor")}
            record[step]["dtypes"] = {key: {str(s[key].dtype) for s in opt.state.values() if key in s}
                                      for key in ("exp_avg", "exp_avg_sq", "anchor")}
        results[(impl, stage, offload)] = record
    if strategy.rank == 0:
        torch.save(results, Path(out) / "zero.pt")
    close(strategies)


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported
    run_plan({"pieces": pieces, "zero": zero})
