"""Which DeepSpeed ZeRO stage can run our optimizer in which precision: one owner for the rule the run
config (strategy.deepspeed.zero_stage, which a stage in the user's own DeepSpeed JSON must equal) and
the Hugging Face Trainer integration (the stage of TrainingArguments' DeepSpeed config) each apply."""

from __future__ import annotations


def unfused_wrapper_problem(stage: int, precision: str) -> str | None:
    """Why ZeRO `stage` in `precision` (fp32, bf16, fp16) cannot run our optimizer, or None (the
    caller names what is valid where it is: the Trainer integration has no ZeRO-3).

    Without ZeRO, DeepSpeed (0.17-0.19, engine._do_optimizer_sanity_check) wraps a client optimizer in
    bf16 or fp16 in its FP16_UnfusedOptimizer, whose set-up steps the optimizer once on zero gradients:
    before theta* is placed (our anchored step refuses it) and, with weight decay, moving the weights
    before the first batch. ZeRO 1-3 wrap it in DeepSpeed's ZeRO optimizers (fp32 masters), which
    do not step before the first batch (tests/unit/strategies/test_deepspeed_stage0.py checks both)."""
    if stage == 0 and precision in ("bf16", "fp16"):
        return ("runs DeepSpeed's FP16_UnfusedOptimizer, which steps the optimizer on zero gradients before the first "
                "batch")
    return None
