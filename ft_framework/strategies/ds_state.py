"""Addressing one model parameter's slice of DeepSpeed ZeRO's flat fp32 partitions.

ZeRO flattens each param group into one fp32 tensor and gives every rank a partition of it; the
wrapped optimizer's state (exp_avg, ..., our ``anchor``) is keyed by that partition. These maps
read and write the *full* value of one parameter's state under any key ("fp32" = the master
weights), with a collective across the data-parallel group, so a checkpoint can be written by
parameter name and loaded on any number of ranks. They also create the per-partition anchor state
and fill it with exact fp32 theta* (each rank only its own part: total/world_size elements).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

MASTER = "fp32"


class Zero12StateMap:
    """ZeRO stage 1/2 (and DeepSpeed's BF16 optimizer): parameters carry ``_hp_mapping``."""

    def __init__(self, zero_optimizer, base_optimizer):
        self.base = base_optimizer
        if hasattr(zero_optimizer, "single_partition_of_fp32_groups"):
            groups, flats = zero_optimizer.bit16_groups, zero_optimizer.single_partition_of_fp32_groups
        else:  # BF16_Optimizer
            groups, flats = zero_optimizer.bf16_groups, zero_optimizer.fp32_groups_flat_partition
        self.groups = [list(g) for g in groups]
        self.flats = list(flats)
        self._flat_of = {id(p): flat for g, flat in zip(self.groups, self.flats) for p in g}

    def partitions(self) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
        return list(zip(self.groups, self.flats))

    def _target(self, p, key) -> torch.Tensor:
        flat = self._flat_of[id(p)]
        return flat if key == MASTER else self.base.state[flat][key]

    def set_full(self, p, key: str, full: torch.Tensor) -> None:
        mapping = p._hp_mapping
        if mapping is not None:
            hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
            source = full.detach().flatten().narrow(0, lp.start, lp.numel)
            target = self._target(p, key)
            target.narrow(0, hp.start, hp.numel).copy_(source.to(target.device, target.dtype))
        if key == MASTER:  # every rank holds the full 16/32-bit model parameter in stage 1/2
            p.data.copy_(full.detach().view_as(p).to(p.device, p.dtype))

    def get_full(self, p, key: str) -> torch.Tensor:
        target = self._target(p, key)
        buffer = torch.zeros(p.numel(), dtype=torch.float32, device=target.device)
        mapping = p._hp_mapping
        if mapping is not None:
            hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
            buffer.narrow(0, lp.start, lp.numel).copy_(target.narrow(0, hp.start, hp.numel))
        dist.all_reduce(buffer, group=p._dp_group)
        return buffer.view(p.shape).cpu()

    def real_slices(self):
        """(flat partition, start, numel) of every real (not padding) element range on this rank."""
        for params, flat in self.partitions():
            for p in params:
                if p._hp_mapping is not None:
                    hp = p._hp_mapping.hp_fragment_address
                    yield flat, hp.start, hp.numel

    def after_master_update(self) -> None:
        pass


class Zero3StateMap:
    """ZeRO stage 3: parameters carry ``ds_id``; the optimizer maps them to sub-group partitions."""

    def __init__(self, zero_optimizer, base_optimizer):
        self.zero = zero_optimizer
        self.base = base_optimizer
        self.groups = [list(g) for g in zero_optimizer.fp16_groups]
        self.flats = list(zero_optimizer.fp32_partitioned_groups_flat)

    def partitions(self):
        return list(zip(self.groups, self.flats))

    def set_full(self, p, key: str, full: torch.Tensor) -> None:
        # Not DeepSpeed's set_full_hp_param: it asserts the unpadded size and then slices at
        # partition_numel * rank, past the end of a padded last partition (37 elements on 2 ranks
        # are stored as 2 x 19). Same copy, with the value padded.
        view, _ = self.zero._get_fp32_opt_state_partition(p, release_swap_buffers=False,
                                                           optim_state_key=None if key == MASTER else key)
        rank = self.zero._get_param_partition_rank(p)
        flat = full.detach().flatten().float()
        end = view.numel() * (rank + 1)
        if end > flat.numel():
            flat = torch.cat([flat, flat.new_zeros(end - flat.numel())])
        view.data.copy_(flat.narrow(0, view.numel() * rank, view.numel()).to(view.device, view.dtype))

    def get_full(self, p, key: str) -> torch.Tensor:
        return self.zero.get_full_hp_param(p, None if key == MASTER else key).float().view(p.ds_shape).cpu()

    def real_slices(self):
        for params, flat in self.partitions():
            for p in params:
                group, offset, numel = self.zero.grad_position[self.zero.get_param_id(p)]
                rank = self.zero._get_param_partition_rank(p)
                # The last rank's partition of a parameter ends in padding.
                real = max(0, min(numel, p.ds_numel - numel * rank))
                if real:
                    yield flat, offset, real

    def after_master_update(self) -> None:
        # The 16/32-bit partitions the forward pass gathers are copies of the fp32 masters.
        for sub_group in range(len(self.flats)):
            self.zero._reassign_or_swap_out_partitioned_parameters(sub_group)


class NoZeroStateMap:
    """Stage 0 in fp32: the optimizer holds the model's own parameters; nothing is partitioned."""

    def __init__(self, base_optimizer, params):
        self.base = base_optimizer
        self.params = list(params)

    def partitions(self):
        return [([p], p) for p in self.params]

    def set_full(self, p, key, full):
        target = p.data if key == MASTER else self.base.state[p][key]
        target.copy_(full.detach().view_as(target).to(target.device, target.dtype))

    def get_full(self, p, key):
        return (p.detach() if key == MASTER else self.base.state[p][key]).float().cpu().clone()

    def real_slices(self):
        for p in self.params:
            yield p, 0, p.numel()

    def after_master_update(self) -> None:
        pass


def state_map_for(engine, base_optimizer, model_params):
    """The map matching how this engine holds the optimizer's tensors."""
    zero = engine.optimizer
    if hasattr(zero, "fp32_partitioned_groups_flat"):
        return Zero3StateMap(zero, base_optimizer)
    if hasattr(zero, "single_partition_of_fp32_groups") or hasattr(zero, "fp32_groups_flat_partition"):
        return Zero12StateMap(zero, base_optimizer)
    return NoZeroStateMap(base_optimizer, model_params)
