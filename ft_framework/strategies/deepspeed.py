"""DeepSpeed ZeRO stages 0-3, optimizer/parameter CPU offload, bf16/fp16, with our optimizer.

Our optimizer is passed to DeepSpeed as an instance, built without anchors. Under
``offload_optimizer`` it receives the fp32 CPU partitions and (impl="auto") runs the C++ kernel on
them; without offload it runs the torch implementation on the device. After
``deepspeed.initialize``, ``place_zero_anchors`` gives every anchored flat partition an ``anchor`` state
tensor and fills it with the exact fp32 pretrained values of its own elements, so each rank holds
total/world_size of theta*.

Gradient accumulation is counted by the trainer alone: it divides each micro-batch's loss and
says which backward ends the accumulation; DeepSpeed is told that boundary
(set_gradient_accumulation_boundary) instead of counting micro-steps itself, and steps once.

Checkpoints: the layout every strategy shares (ft_framework/checkpointing): every rank writes the
fragments of its partitions (fp32 masters, moments, anchors, steps) by parameter name through
torch.distributed.checkpoint, and the checkpoint loads under any strategy and number of ranks.
DeepSpeed's own checkpoint is not written (nothing measured favours it), nor is any file one rank
fills by gathering; its universal-checkpoint converter would drop the anchors (it keeps only the
optimizer-state keys Adam has).

Every DeepSpeed internal this needs lives in deepspeed_adapter.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from ft_framework.distributed import collectives
from ft_framework.errors import UserError
from ft_framework.strategies.base import Strategy, anchors_for
from ft_framework.strategies.checkpointable import StrategyCheckpoint
from ft_framework.distributed.process_group import ProcessGroupMixin


def build_deepspeed_config(ds_cfg, training_cfg) -> dict[str, Any]:
    """DeepSpeed's JSON config from our YAML: the user's own config (inline or file) if given, with
    batch size, accumulation, clipping, precision and the ZeRO stage set from the run config (a
    contradicting value in the user's config is an error: one source of truth)."""
    if ds_cfg.config_file:
        user = json.loads(Path(ds_cfg.config_file).read_text())
    else:
        user = dict(ds_cfg.config or {})
    ours: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": training_cfg.per_device_batch_size,
        "gradient_accumulation_steps": training_cfg.gradient_accumulation_steps,
        "gradient_clipping": float(training_cfg.max_grad_norm or 0.0),
        "bf16": {"enabled": training_cfg.precision == "bf16"},
        "fp16": {"enabled": training_cfg.precision == "fp16"},
    }
    for key, value in ours.items():
        if key in user and user[key] != value and not (isinstance(value, dict) and user[key].get("enabled") == value["enabled"]):
            raise ValueError(f"DeepSpeed config sets {key}={user[key]!r} but the run config implies {value!r}; "
                             "set it in the run config (training.*) and remove it from the DeepSpeed config")
    config = {**user, **{k: v for k, v in ours.items() if k not in user}}
    zero = dict(user.get("zero_optimization", {}))
    # The run config's rules (config/schema.py, config/deepspeed_stage.py) read strategy.deepspeed.zero_stage:
    # a different stage in the user's JSON would run unchecked.
    if "stage" in zero and zero["stage"] != ds_cfg.zero_stage:
        raise UserError(f"the DeepSpeed config sets zero_optimization.stage={zero['stage']!r} but "
                        f"strategy.deepspeed.zero_stage is {ds_cfg.zero_stage}; set strategy.deepspeed.zero_stage: "
                        f"{zero['stage']!r} (the run config's checks read it) and remove the stage from the "
                        "DeepSpeed config")
    zero["stage"] = ds_cfg.zero_stage
    # Pinned host memory makes the GPU<->CPU copies of the offloaded partitions asynchronous DMA
    # (DeepSpeed's default is pageable memory); there is nothing to pin for on a CPU-only run.
    on_cuda = training_cfg.device == "cuda" or (training_cfg.device == "auto" and torch.cuda.is_available())
    offload = {"device": "cpu", "pin_memory": True} if on_cuda else {"device": "cpu"}
    if ds_cfg.offload_optimizer:
        zero.setdefault("offload_optimizer", dict(offload))
    if ds_cfg.offload_param:
        zero.setdefault("offload_param", dict(offload))
    config["zero_optimization"] = zero
    # Our optimizer runs the offloaded step itself (the C++ kernel); DeepSpeed must not insist
    # on its own DeepSpeedCPUAdam.
    config.setdefault("zero_force_ds_cpu_optimizer", False)
    config.setdefault("zero_allow_untested_optimizer", True)  # ours is tested here, against Adam's rules
    config.setdefault("steps_per_print", 2**31 - 1)
    config.setdefault("wall_clock_breakdown", False)
    return config


@torch.no_grad()
def place_zero_anchors(engine, optimizer, anchors: Mapping[str, torch.Tensor], state_map=None) -> None:
    """theta* into a DeepSpeed engine's partitions: every partition of `optimizer`'s anchored groups
    (ZeRO flattens each param group on its own, so a partition is anchored or not with its group)
    gets a zero anchor of its own size, filled with the exact fp32 theta* of its elements; each
    rank reads only its part of each full tensor. `optimizer` is ours (the one `engine` wraps);
    `state_map` is the adapter's map of the engine when the caller has one. Used by the
    DeepSpeed strategy and by the Hugging Face Trainer integration."""
    named = list(engine.module.named_parameters())
    wanted = anchors_for(optimizer, anchors, (n for n, _ in named))
    if state_map is None:
        from ft_framework.strategies import deepspeed_adapter  # imports deepspeed (lazily, like the strategy)

        state_map = deepspeed_adapter.state_map_for(engine, optimizer, [p for _, p in named])
    name_of = {id(p): n for n, p in named}
    for params, flat in state_map.partitions():
        if not params or name_of[id(params[0])] not in wanted:
            continue
        optimizer.init_anchor(flat)  # one anchor per partition (per parameter at stage 0), filled piece by piece
        for p in params:
            state_map.set_full(p, "anchor", anchors[name_of[id(p)]])


class DeepSpeedStrategy(ProcessGroupMixin, Strategy):
    name = "deepspeed"

    def __init__(self, ds_cfg, training_cfg):
        if training_cfg.device == "cpu" or (training_cfg.device == "auto" and not torch.cuda.is_available()):
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported
        super().__init__("fp32", training_cfg.device)  # DeepSpeed casts; no autocast on top
        self.precision = training_cfg.precision
        self.ds_config = build_deepspeed_config(ds_cfg, training_cfg)
        self.zero_stage = int(self.ds_config["zero_optimization"]["stage"])
        from ft_framework.strategies import deepspeed_adapter  # checks the DeepSpeed version; imports it first

        import deepspeed

        self._deepspeed = deepspeed
        self._adapter = deepspeed_adapter
        self._join_process_group(
            "deepspeed", "deepspeed launch/train.py --config ... (or torchrun --nproc_per_node N launch/train.py ...)",
            init=lambda backend: deepspeed.init_distributed(dist_backend=backend))

    # ---- topology ------------------------------------------------------------------------------
    @property
    def optimizer_state_is_partitioned(self) -> bool:
        # Stage 0 runs in fp32 only (the config refuses DeepSpeed's unfused bf16/fp16 wrapper): whole state.
        return self.zero_stage > 0

    # ---- set-up ----------------------------------------------------------------------------------
    def setup(self, model: nn.Module, build_optimizer, anchors=None):
        optimizer = build_optimizer(model)
        compact = getattr(optimizer, "compact", False)
        if compact:
            # DeepSpeed owns the fp32 masters (its flat partitions, copied into the model after each
            # step): the compact state keeps its bf16 moments and theta* beside them, and no delta.
            optimizer.keep_masters_in_params()
        if any("anchor" in s for s in optimizer.state.values()):
            raise ValueError("DeepSpeed repartitions the optimizer's parameters, so anchors in its param groups "
                             "would be lost: build the param groups without anchors "
                             "(build_param_groups(..., attach_anchors=False)) and pass theta* as setup(anchors=...)")
        engine, _, _, _ = self._deepspeed.initialize(model=model, optimizer=optimizer, config=self.ds_config)
        # initialize ran collectives of the whole group: every rank has mapped this rank's all-reduce
        # segment from now on, and close() removes it, whatever became of the engine by then (a
        # benchmark drops it before close to measure the next one).
        self._allreduce_segment_mapped = True
        self.engine = engine
        self.model = engine
        self.optimizer = optimizer  # ours; ZeRO's wrapper shares its param_groups
        self.state_map = self._adapter.state_map_for(engine, optimizer, engine.module.parameters())
        if compact:  # each partition's elements round with their global indices, as one process's
            for flat, base in self.state_map.index_bases():
                optimizer.set_index_base(flat, base)
        if anchors:
            self.place_anchors(anchors)
        return self.model, self.optimizer

    def _named_model_params(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.engine.module.named_parameters())

    def place_anchors(self, anchors) -> None:
        place_zero_anchors(self.engine, self.optimizer, anchors, self.state_map)

    # ---- the step --------------------------------------------------------------------------------
    def forward(self, batch, last_micro_batch: bool = True):  # the boundary is set in backward
        return self.engine(**batch)

    def backward(self, loss: torch.Tensor, last_micro_batch: bool = True) -> None:
        # The trainer counted and divided: DeepSpeed neither divides again (scale_wrt_gas=False) nor
        # counts (its gradient_accumulation_steps only sizes train_batch_size); it is told whether
        # this backward ends the accumulation, where ZeRO reduces the gradients.
        self.engine.set_gradient_accumulation_boundary(last_micro_batch)
        self.engine.backward(loss, scale_wrt_gas=False)

    def clip_and_step(self, max_grad_norm: float | None) -> float:
        # DeepSpeed clips inside step(), at gradient_clipping from its config, which
        # build_deepspeed_config writes from training.max_grad_norm: a different value here
        # would be silently ignored, so it is an error.
        configured = float(self.ds_config.get("gradient_clipping") or 0.0)
        if float(max_grad_norm or 0.0) != configured:
            raise ValueError(f"clip_and_step(max_grad_norm={max_grad_norm}) but DeepSpeed clips at gradient_clipping="
                             f"{configured} from its config; set training.max_grad_norm, which writes it")
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def step_unclipped(self) -> None:
        # DeepSpeed clips inside engine.step() (the ZeRO/BF16 optimizer's clip_grad, or the engine's
        # own fp32 clip at stage 0): both off for this step. The engine's step counters are put
        # back, so that a step the optimizer did not take is not counted.
        engine = self.engine
        counters = self._adapter.engine_extra_state(engine)
        config_clip, zero = engine._config.gradient_clipping, engine.optimizer
        zero_clip = getattr(zero, "clip_grad", None)
        engine._config.gradient_clipping = 0.0
        if zero_clip is not None:
            zero.clip_grad = 0.0
        try:
            engine.step()
        finally:
            engine._config.gradient_clipping = config_clip
            if zero_clip is not None:
                zero.clip_grad = zero_clip
            self._adapter.load_engine_extra_state(engine, counters)

    def unwrapped_model(self) -> nn.Module:
        return self.engine.module

    def close(self) -> None:
        # Once deepspeed.initialize has run (setup), every rank has mapped this rank's all-reduce
        # segment: it can go (before that, a rank still starting would wait for it).
        mapped = getattr(self, "_allreduce_segment_mapped", False)
        super().close()
        if mapped:
            self._adapter.remove_shm_allreduce_segment(self.rank)
            self._allreduce_segment_mapped = False

    # ---- telemetry -------------------------------------------------------------------------------
    def gather_full_state(self, key: str) -> dict[str, torch.Tensor]:
        """Full value of optimizer state `key` ('fp32' = master weights) per parameter name
        (collective: every rank must call it)."""
        return {name: self.state_map.get_full(p, key) for name, p in self._named_model_params()
                if key == self._adapter.MASTER or self._partition_has(p, key)}

    def _partition_has(self, p, key: str) -> bool:
        for params, flat in self.state_map.partitions():
            if any(q is p for q in params):
                return key in self.optimizer.state.get(flat, {})
        return False

    def forgetting_distance(self) -> float:
        """||theta - theta*||_2 from each rank's partitions (padding excluded), one all-reduce."""
        total = torch.zeros((), dtype=torch.float64)
        for flat, start, numel in self.state_map.real_slices():
            anchor = self.optimizer.state.get(flat, {}).get("anchor")
            if anchor is None:
                continue
            theta = flat.detach().reshape(-1).narrow(0, start, numel).double()
            total += (theta - anchor.reshape(-1).narrow(0, start, numel).double()).square().sum().cpu()
        if self.optimizer_state_is_partitioned:
            total = collectives.all_reduce(total)
        return float(total.sqrt())

    def anchor_numel_on_this_rank(self) -> int:
        return sum(s["anchor"].numel() for s in self.optimizer.state.values() if "anchor" in s)

    # ---- checkpoints -------------------------------------------------------------------------------
    # The base class's save/load (ft_framework/checkpointing) with ZeRO's layout: each rank's
    # fragments of its flat partitions (stages 1/2), its parameter partitions (stage 3) or whole
    # tensors from rank 0 (stage 0 in fp32), from deepspeed_adapter. DeepSpeed's own checkpoint is
    # not written: the sharded layout saves faster and with less memory (docs/benchmarks.md) and
    # loads under any strategy and world size, anchors included.
    def checkpointable(self) -> "_ZeroCheckpoint":
        return _ZeroCheckpoint(self)


class _ZeroCheckpoint(StrategyCheckpoint):
    """ZeRO's layout through the adapter's state map, and the engine's counters and loss scaler."""

    def fragments(self) -> list:
        s = self.strategy
        return s.state_map.fragments(s._named_model_params(), s.is_main_process)

    def prepare_load(self) -> None:
        for _params, flat in self.strategy.state_map.partitions():
            self.strategy.optimizer.init_state(flat)

    def after_load(self) -> None:
        self.strategy.state_map.after_load()

    def extra_state(self) -> Any:
        return self.strategy._adapter.engine_extra_state(self.strategy.engine)

    def load_extra_state(self, state: Any) -> None:
        self.strategy._adapter.load_engine_extra_state(self.strategy.engine, state)

    def info(self) -> dict[str, Any]:
        s = self.strategy
        return {**super().info(), "zero_stage": s.zero_stage,
                "offload_optimizer": "offload_optimizer" in s.ds_config["zero_optimization"]}
