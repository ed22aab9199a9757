"""The importance F~ in the memory plan (ft-plan, the rows ft-train logs): 2 bytes per anchored
parameter, on a line of its own, placed and sharded as theta* is under every strategy."""

import pytest

from ft_framework.config import validate_config
from ft_framework.strategies.memory_plan import format_memory_plan, plan_memory

LINE = "importance F~ of theta* (bf16)"


def decoder(strategy: dict, importance: bool = True, anchor_dtype: str = "float32", precision: str = "fp32") -> object:
    return validate_config({
        "model": {"name_or_path": "some/decoder"},
        "data": {"problem": "causal_lm", "source": "builtin:quickstart_sft"},
        "optimizer": {"name": "ewc" if importance else "recadam", "hparams": {"lr": 2e-5},
                      "anchor_dtype": anchor_dtype, "importance": {"source": "probe"} if importance else None},
        "schedule": {"warmup_steps": 0},
        "training": {"max_steps": 1, "precision": precision},
        "strategy": strategy,
    })


UNDO = "undo copies of importance-weighted speculative steps (fp32 m, v and weight)"


def rows(cfg, world_size: int) -> dict:
    return {r.what: (r.device_bytes, r.cpu_bytes) for r in plan_memory(cfg, world_size=world_size, num_params=1000,
                                                                       num_anchored=800)}


@pytest.mark.parametrize("strategy,world,want", [
    ({"name": "single"}, 1, (1600, 0)),
    ({"name": "ddp"}, 2, (1600, 0)),                                                  # replicated
    ({"name": "fsdp"}, 2, (800, 0)),                                                  # sharded like theta*
    ({"name": "fsdp", "fsdp": {"cpu_offload": True}}, 2, (0, 800)),
    ({"name": "deepspeed", "deepspeed": {"zero_stage": 1}}, 4, (400, 0)),
    ({"name": "deepspeed", "deepspeed": {"zero_stage": 3, "offload_optimizer": True}}, 4, (0, 400)),
    ({"name": "single", "offload_optimizer": {"overlap": True}}, 1, (0, 1600)),          # with the host state
])
def test_two_bytes_per_anchored_parameter_where_theta_star_is(strategy, world, want):
    got = rows(decoder(strategy), world)
    assert got[LINE] == want
    without = rows(decoder(strategy, importance=False), world)
    # The overlapped offload also keeps undo copies of its weighted speculative steps (an element
    # pulled onto theta* has no inverse): fp32 m, v and weight of the anchored parameters, 12 bytes each.
    undo = {UNDO: (0.0, 800 * 12)} if strategy.get("offload_optimizer", {}).get("overlap") else {}
    assert LINE not in without and set(got) - set(without) == {LINE, *undo}
    assert {k: v for k, v in got.items() if k not in (LINE, UNDO)} == without and {
        k: v for k, v in got.items() if k == UNDO} == undo
    # its own line, right after theta*'s, in what ft-train logs
    lines = format_memory_plan(plan_memory(decoder(strategy), world_size=world, num_params=1000, num_anchored=800),
                               strategy=strategy["name"], world_size=world).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(LINE))
    assert lines[at - 1].startswith("anchors theta*")


def test_bf16_anchors_do_not_change_its_bytes():
    assert rows(decoder({"name": "single"}, anchor_dtype="bfloat16"), 1)[LINE] == (1600, 0)
