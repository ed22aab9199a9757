"""Every case of tests/distributed/test_checkpoint_reshard.py, in three steps of rank_launcher's plan,
the ranks of each forked from ONE process (tests/distributed/rank_launcher.py: a launch costs far
more than a case):

    python reshard_worker.py PLAN     (the steps save, one, two, each with out=OUT_DIR)

Step "save" (2 ranks): ZeRO-2 (RI), FSDP2 (PI), ZeRO-2 bf16 (RI) train 3 steps, save, train 2 more
  and save again (the uninterrupted run); a run with anchors refuses a checkpoint without them.
Step "one" (1 rank): ZeRO-2 on 2 -> FSDP2 on 1; DeepSpeed (ZeRO-2) -> single; ZeRO-2 bf16 ->
  single (theta* exact); ZeRO-1 on 1 trains 3 steps and saves.
Step "two" (2 ranks): FSDP2 on 2 -> ZeRO-3 on 2; ZeRO-1 on 1 -> ZeRO-3 + offload on 2; ZeRO-2 on 2
  -> ZeRO-2 on 2 (same size); FSDP2 on 2 -> DDP on 2.

Each load is followed by a save ("<case>_loaded": must equal the source checkpoint bit for bit),
two more steps and a save ("<case>_final": compared with the one-process reference). Errors go to
OUT_DIR/errors_<step>.json.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from rank_launcher import preimport_deepspeed_initialize, run_plan  # noqa: E402
from reshard_common import HPARAMS, LR, STEPS, RESUME_AT, batch_for_rank, make_model_and_anchors  # noqa: E402

from ft_framework.config import DeepSpeedConfig, FSDPConfig, TrainingConfig  # noqa: E402
from ft_framework.optim import build_optimizer  # noqa: E402
from ft_framework.optim.groups import build_param_groups  # noqa: E402
from ft_framework.strategies import SingleDeviceStrategy  # noqa: E402
from ft_framework.strategies.ddp import DDPStrategy  # noqa: E402
from ft_framework.strategies.deepspeed import DeepSpeedStrategy  # noqa: E402
from ft_framework.strategies.fsdp import FSDPStrategy  # noqa: E402


def make_strategy(kind: str, mode: str, *, precision: str = "fp32"):
    """kind: single, ddp, fsdp, zero1, zero2, zero3, zero3_offload; mode: PI or RI."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if kind == "single":
        strategy = SingleDeviceStrategy(precision, "cpu")
    elif kind == "ddp":
        strategy = DDPStrategy(precision, "cpu")
    elif kind == "fsdp":
        strategy = FSDPStrategy(FSDPConfig(), SimpleNamespace(precision=precision, device="cpu"))
    else:
        stage = int(kind[4])
        offload = kind.endswith("offload")
        ds = DeepSpeedConfig(zero_stage=stage, offload_optimizer=offload, offload_param=offload and stage == 3)
        training = TrainingConfig(max_steps=STEPS, per_device_batch_size=8 // world, device="cpu",
                                  max_grad_norm=None, precision=precision)
        strategy = DeepSpeedStrategy(ds, training)
    model, anchors = make_model_and_anchors(mode)

    def build(m):
        groups = build_param_groups(m, anchors, lr=LR, weight_decay=0.01, attach_anchors=False)
        return build_optimizer("recadam", groups, impl="torch", **HPARAMS)

    strategy.setup(model, build, anchors=anchors)
    return strategy


def train(strategy, steps):
    for step in steps:
        strategy.model.train()
        out = strategy.forward(batch_for_rank(step, strategy.rank, strategy.world_size))
        strategy.backward(out.loss)
        strategy.clip_and_step(None)


def save(strategy, out: Path, name: str) -> None:
    directory = out / name
    if strategy.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    strategy.barrier()
    strategy.save_checkpoint(directory)
    strategy.barrier()


def close(strategy) -> None:
    """Frees a strategy so the next one in the same launch starts clean (DeepSpeed keeps hooks)."""
    engine = getattr(strategy, "engine", None)
    if engine is not None and hasattr(engine, "destroy"):
        engine.destroy()


def evaluate(strategy):
    """A forward without backward, as the trainer's evaluation: FSDP2 then keeps the root
    module's parameters unsharded (a checkpoint must still see the shards)."""
    strategy.model.eval()
    with torch.no_grad():
        strategy.forward(batch_for_rank(0, strategy.rank, strategy.world_size))


def run_and_save(out, name, kind, mode, **kw):
    s = make_strategy(kind, mode, **kw)
    train(s, range(RESUME_AT))
    evaluate(s)
    save(s, out, name)
    train(s, range(RESUME_AT, STEPS))
    save(s, out, f"{name}_straight")
    close(s)


def resume(out, source, name, kind, mode, **kw):
    s = make_strategy(kind, mode, **kw)
    evaluate(s)  # parameters left unsharded (FSDP2) must not hide what the load writes
    s.load_checkpoint(out / source)
    save(s, out, f"{name}_loaded")
    train(s, range(RESUME_AT, STEPS))
    save(s, out, f"{name}_final")
    close(s)


def expect_error(errors, label, fn):
    try:
        fn()
        errors[label] = "no error"
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        errors[label] = f"{type(exc).__name__}: {exc}"


def phase_save(out, errors):
    run_and_save(out, "zero2_2", "zero2", "RI")
    run_and_save(out, "fsdp_2", "fsdp", "PI")
    run_and_save(out, "zero2bf16_2", "zero2", "RI", precision="bf16")
    # A checkpoint without anchors (a run that anchors nothing) into a run that anchors: refused
    # on every rank before anything is read (no rank left waiting in a collective).
    s = make_strategy("zero2", "RI")
    expect_error(errors, "missing_anchor", lambda: s.load_checkpoint(out / "no_anchor"))
    close(s)


def phase_one(out, errors):
    resume(out, "zero2_2", "zero2_2_to_fsdp_1", "fsdp", "RI")
    resume(out, "zero2_2", "zero2_2_to_single", "single", "RI")
    resume(out, "zero2bf16_2", "zero2bf16_2_to_single", "single", "RI")
    run_and_save(out, "zero1_1", "zero1", "RI")


def phase_two(out, errors):
    resume(out, "fsdp_2", "fsdp_2_to_zero3_2", "zero3", "PI")
    resume(out, "zero1_1", "zero1_1_to_zero3off_2", "zero3_offload", "RI")
    resume(out, "zero2_2", "zero2_2_to_zero2_2", "zero2", "RI")
    resume(out, "fsdp_2", "fsdp_2_to_ddp_2", "ddp", "PI")


PLAN_STEPS = {"save": phase_save, "one": phase_one, "two": phase_two}  # the test's plan: in this order


def run(name: str, out: str) -> None:
    """Step `name` on this rank; rank 0 writes the errors it expected to OUT_DIR/errors_<name>.json."""
    errors: dict[str, str] = {}
    PLAN_STEPS[name](Path(out), errors)
    if int(os.environ["RANK"]) == 0:
        (Path(out) / f"errors_{name}.json").write_text(json.dumps(errors))


if __name__ == "__main__":
    preimport_deepspeed_initialize()
    run_plan({name: functools.partial(run, name) for name in PLAN_STEPS})
