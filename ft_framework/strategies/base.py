"""The one interface the trainer talks to; each backend (single device, DDP, DeepSpeed, FSDP)
implements it, so the training loop never branches on the backend."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
from torch import nn


class Strategy(ABC):
    """Owns device placement, the wrapped model and optimizer, backward/step, and checkpoints."""

    name: str = "base"

    def __init__(self, precision: str = "fp32", device: str = "auto"):
        self.precision = precision
        self.device = self._pick_device(device)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        if precision == "fp16" and self.device.type != "cuda":
            raise ValueError("training.precision fp16 needs a CUDA device (with a loss scaler); "
                             "use bf16 or fp32 on CPU")

    # ---- process topology ------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def params_are_sharded(self) -> bool:
        """True when each rank's optimizer holds a disjoint shard (ZeRO, FSDP): reduce telemetry."""
        return False

    def barrier(self) -> None:
        pass

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (a one-element list without distribution)."""
        return [obj]

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    # ---- setup -------------------------------------------------------------------------------
    @staticmethod
    def _pick_device(device: str) -> torch.device:
        if device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("training.device is 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
        return torch.device(device)

    @abstractmethod
    def setup(self, model: nn.Module, build_optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Places/wraps the model and builds the optimizer with `build_optimizer(model)`."""

    # ---- the step ------------------------------------------------------------------------------
    def autocast(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def forward(self, batch: dict[str, torch.Tensor]):
        with self.autocast():
            return self.model(**batch)

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None: ...

    @abstractmethod
    def clip_and_step(self, max_grad_norm: float | None) -> float:
        """Clips gradients (when max_grad_norm is set), steps the optimizer, zeroes gradients;
        returns the gradient norm before clipping."""

    def unwrapped_model(self) -> nn.Module:
        return self.model

    def forgetting_distance(self) -> float | None:
        """||theta - theta*||_2 over the anchored parameters, summed over shards when sharded."""
        if not hasattr(self.optimizer, "forgetting_distance"):
            return None
        return self.optimizer.forgetting_distance(all_reduce=self.params_are_sharded)

    def current_lambdas(self) -> list[float | None] | None:
        return self.optimizer.current_lambdas() if hasattr(self.optimizer, "current_lambdas") else None

    # ---- checkpoints (atomic directory writes are the trainer's job) --------------------------
    @abstractmethod
    def save_checkpoint(self, directory: Path) -> None:
        """Writes model and optimizer state into `directory` (which exists)."""

    @abstractmethod
    def load_checkpoint(self, directory: Path) -> None:
        """Restores model and optimizer state written by save_checkpoint."""

    def consolidated_model(self) -> nn.Module:
        """The full model on this process, for save_pretrained export (rank 0 writes it)."""
        return self.unwrapped_model()

    def close(self) -> None:
        pass
