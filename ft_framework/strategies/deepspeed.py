"""DeepSpeed ZeRO stages 0-3, optimizer/parameter CPU offload, bf16/fp16, with our optimizer.

Our optimizer is passed to DeepSpeed as an instance. Under ``offload_optimizer`` it receives the
fp32 CPU partitions and (impl="auto") runs the C++ kernel on them; without offload it runs the
torch implementation on the device. theta* anchors are taken out of the optimizer before
``deepspeed.initialize`` and re-attached to the flat partitions as an ``anchor`` state tensor,
filled from the exact fp32 pretrained values, so each rank holds total/world_size of them.

Checkpoints: DeepSpeed's own checkpoint (parallel, each rank its shard; the wrapped optimizer's
state dict carries the anchors) for a same-size resume, plus one consolidated file keyed by
parameter name (fp32 master weights, moments, anchors, step) that resumes on any number of ranks.
DeepSpeed's universal-checkpoint converter drops optimizer keys other than Adam's, anchors among
them (shared/spec/FACTS.md), hence the file of our own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .base import Strategy
from .ds_state import MASTER, state_map_for
from .process_group import ProcessGroupMixin

NATIVE_TAG = "deepspeed"
CONSOLIDATED_FILE = "consolidated_optimizer.pt"
META_FILE = "deepspeed_meta.json"
CONSOLIDATED_FORMAT = "ft_framework.consolidated_optimizer/1"
OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq")


def build_deepspeed_config(ds_cfg, training_cfg) -> dict[str, Any]:
    """DeepSpeed's JSON config from our YAML: the user's own config (inline or file) if given, with
    batch size, accumulation, clipping and precision set from the run config (a contradicting
    value in the user's config is an error: one source of truth)."""
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
    zero.setdefault("stage", ds_cfg.zero_stage)
    if ds_cfg.offload_optimizer:
        zero.setdefault("offload_optimizer", {"device": "cpu"})
    if ds_cfg.offload_param:
        zero.setdefault("offload_param", {"device": "cpu"})
    config["zero_optimization"] = zero
    # Our optimizer runs the offloaded step itself (the C++ kernel); DeepSpeed must not insist
    # on its own DeepSpeedCPUAdam.
    config.setdefault("zero_force_ds_cpu_optimizer", False)
    config.setdefault("zero_allow_untested_optimizer", True)  # ours is tested here, against Adam's rules
    config.setdefault("steps_per_print", 2**31 - 1)
    config.setdefault("wall_clock_breakdown", False)
    return config


class DeepSpeedStrategy(ProcessGroupMixin, Strategy):
    name = "deepspeed"

    def __init__(self, ds_cfg, training_cfg):
        if training_cfg.device == "cpu" or (training_cfg.device == "auto" and not torch.cuda.is_available()):
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported
        super().__init__("fp32", training_cfg.device)  # DeepSpeed casts; no autocast on top
        self.precision = training_cfg.precision
        self.ds_config = build_deepspeed_config(ds_cfg, training_cfg)
        self.zero_stage = int(self.ds_config["zero_optimization"]["stage"])
        self.accumulation = training_cfg.gradient_accumulation_steps
        import deepspeed

        self._deepspeed = deepspeed
        self._join_process_group(
            "deepspeed", "deepspeed launch/train.py --config ... (or torchrun --nproc_per_node N launch/train.py ...)",
            init=lambda backend: deepspeed.init_distributed(dist_backend=backend))
        self._micro_steps = 0

    # ---- topology ------------------------------------------------------------------------------
    @property
    def params_are_sharded(self) -> bool:
        return self.zero_stage > 0 or self.precision == "bf16"

    # ---- set-up ----------------------------------------------------------------------------------
    def setup(self, model: nn.Module, build_optimizer):
        optimizer = build_optimizer(model)
        self.names = {id(p): n for n, p in model.named_parameters()}
        # Anchors leave the optimizer before DeepSpeed repartitions it, keyed by parameter name.
        anchors = {}
        for name, p in model.named_parameters():
            state = optimizer.state.get(p)
            if state and "anchor" in state:
                anchors[name] = state.pop("anchor")
                if not state:
                    del optimizer.state[p]
        engine, _, _, _ = self._deepspeed.initialize(model=model, optimizer=optimizer, config=self.ds_config)
        self.engine = engine
        self.model = engine
        self.optimizer = optimizer  # ours; ZeRO's wrapper shares its param_groups
        self.state_map = state_map_for(engine, optimizer, engine.module.parameters())
        self._attach_anchors(anchors)
        return self.model, self.optimizer

    def _named_model_params(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.engine.module.named_parameters())

    @torch.no_grad()
    def _attach_anchors(self, anchors: dict[str, torch.Tensor]) -> None:
        """Creates the anchor state of every anchored partition and fills it with exact theta*."""
        dtype = getattr(self.optimizer, "_anchor_dtype", torch.float32)
        name_of = {id(p): n for n, p in self._named_model_params()}
        for params, flat in self.state_map.partitions():
            anchored = [p for p in params if name_of[id(p)] in anchors]
            if not anchored:
                continue
            if len(anchored) != len(params):
                missing = [name_of[id(p)] for p in params if name_of[id(p)] not in anchors]
                raise ValueError(f"a DeepSpeed partition mixes anchored and new parameters ({missing[:3]}...): "
                                 "put new (head) parameters in their own param group")
            # One anchor tensor per partition (per parameter at stage 0), filled piece by piece.
            self.optimizer.state[flat]["anchor"] = torch.zeros_like(flat, dtype=dtype)
            for p in anchored:
                self.state_map.set_full(p, "anchor", anchors[name_of[id(p)]])

    # ---- the step --------------------------------------------------------------------------------
    def forward(self, batch):
        return self.engine(**batch)

    def backward(self, loss: torch.Tensor) -> None:
        # The trainer already divides by the accumulation steps; DeepSpeed must not divide again.
        self.engine.backward(loss, scale_wrt_gas=False)
        self._micro_steps += 1
        if self._micro_steps % self.accumulation != 0:
            self.engine.step()  # not a boundary: DeepSpeed only advances its micro-step count

    def clip_and_step(self, max_grad_norm: float | None) -> float:
        # Clipping is DeepSpeed's (gradient_clipping in its config), done inside step().
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def unwrapped_model(self) -> nn.Module:
        return self.engine.module

    # ---- telemetry -------------------------------------------------------------------------------
    def gather_full_state(self, key: str) -> dict[str, torch.Tensor]:
        """Full value of optimizer state `key` ('fp32' = master weights) per parameter name
        (collective: every rank must call it)."""
        return {name: self.state_map.get_full(p, key) for name, p in self._named_model_params()
                if key == MASTER or self._partition_has(p, key)}

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
        if self.params_are_sharded:
            dist.all_reduce(total)
        return float(total.sqrt())

    def anchor_numel_on_this_rank(self) -> int:
        return sum(s["anchor"].numel() for s in self.optimizer.state.values() if "anchor" in s)

    # ---- checkpoints -------------------------------------------------------------------------------
    def save_checkpoint(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory), tag=NATIVE_TAG, save_latest=False)
        consolidated = self._consolidate()
        if self.is_main_process:
            torch.save(consolidated, directory / CONSOLIDATED_FILE)
            (directory / META_FILE).write_text(json.dumps(
                {"world_size": self.world_size, "zero_stage": self.zero_stage, "precision": self.precision}))
        self.barrier()

    def _consolidate(self) -> dict[str, Any]:
        params: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in self._named_model_params():
            entry = {MASTER: self.state_map.get_full(p, MASTER)}
            for key in OPTIMIZER_KEYS + ("anchor",):
                if self._partition_has(p, key):
                    entry[key] = self.state_map.get_full(p, key)
            params[name] = entry
        steps = [int(s["step"]) for s in self.optimizer.state.values() if "step" in s]
        return {"format": CONSOLIDATED_FORMAT, "step": max(steps, default=0), "params": params}

    def load_checkpoint(self, directory: Path) -> None:
        meta_path = directory / META_FILE
        if not meta_path.is_file():
            raise FileNotFoundError(f"{directory} is not a DeepSpeed checkpoint of ft_framework (no {META_FILE})")
        meta = json.loads(meta_path.read_text())
        if meta["world_size"] == self.world_size and meta["zero_stage"] == self.zero_stage:
            try:
                path, _ = self.engine.load_checkpoint(str(directory), tag=NATIVE_TAG,
                                                      load_optimizer_states=True, load_lr_scheduler_states=False)
            except Exception as exc:
                raise RuntimeError(f"checkpoint {directory} cannot be read ({exc}); "
                                   "resume from an earlier checkpoint") from exc
            if path is None:
                raise RuntimeError(f"DeepSpeed found no checkpoint in {directory}")
            self._check_anchors_present()
        else:
            self.load_consolidated(directory / CONSOLIDATED_FILE)
        self.barrier()

    def _check_anchors_present(self) -> None:
        for params, flat in self.state_map.partitions():
            state = self.optimizer.state.get(flat, {})
            if "anchor" in state and tuple(state["anchor"].shape) != tuple(flat.shape):
                raise ValueError(f"checkpoint anchor has shape {tuple(state['anchor'].shape)}, the partition "
                                 f"{tuple(flat.shape)}: wrong or corrupted checkpoint")

    @torch.no_grad()
    def load_consolidated(self, path: Path) -> None:
        """Loads master weights, moments, anchors and step counts by parameter name (any world size)."""
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise RuntimeError(f"checkpoint file {path} cannot be read ({exc}); resume from an earlier checkpoint") from exc
        if saved.get("format") != CONSOLIDATED_FORMAT:
            raise ValueError(f"{path} is not an ft_framework consolidated optimizer checkpoint")
        named = self._named_model_params()
        missing = [n for n, _ in named if n not in saved["params"]]
        if missing:
            raise ValueError(f"checkpoint {path} lacks parameters {missing[:5]}: it belongs to another model")
        anchored_now = {n for params, flat in self.state_map.partitions()
                        if "anchor" in self.optimizer.state.get(flat, {})
                        for n in (self.names.get(id(p)) for p in params) if n}
        for name, p in named:
            entry = saved["params"][name]
            shape = tuple(getattr(p, "ds_shape", p.shape))
            for key, value in entry.items():
                if tuple(value.shape) != shape:
                    raise ValueError(f"checkpoint {key} of {name} has shape {tuple(value.shape)}, the model "
                                     f"{shape}: wrong or corrupted checkpoint")
            if name in anchored_now and "anchor" not in entry:
                raise ValueError(f"checkpoint has no anchor (theta*) for {name}, which this run anchors; "
                                 "loading it would silently drop the pull toward the pretrained weights")
        step = torch.tensor(float(saved["step"]))
        for params, flat in self.state_map.partitions():
            state = self.optimizer.state[flat]
            for key in OPTIMIZER_KEYS:
                state.setdefault(key, torch.zeros_like(flat, dtype=torch.float32))
            state["step"] = step.clone()
        for name, p in named:
            for key, value in saved["params"][name].items():
                self.state_map.set_full(p, key, value)
        self.state_map.after_master_update()

    # ---- export ----------------------------------------------------------------------------------
    def consolidated_model(self) -> nn.Module:
        """A plain fp32 copy of the model built from the gathered master weights (collective)."""
        masters = {name: self.state_map.get_full(p, MASTER) for name, p in self._named_model_params()}
        module = self.engine.module
        plain = type(module)(module.config)
        missing, unexpected = plain.load_state_dict(masters, strict=False)
        if unexpected:
            raise RuntimeError(f"export: unexpected tensors {unexpected[:5]}")
        return plain
