"""TEMPORARY: the sharded-checkpoint protocol attached to today's strategies from outside, until
the strategies implement it themselves (then this file goes)."""

from __future__ import annotations

import types

import torch

from ft_framework.checkpointing import (MASTER, STEP, Fragment, dtensor_fragments, param_info,
                                        whole_tensor_fragments)


def _trainable(optimizer):
    return [p for g in optimizer.param_groups for p in g["params"]]


def _anchored_names_by_param(strategy):
    model = strategy.unwrapped_model()
    return {n for n, p in model.named_parameters() if "anchor" in strategy.optimizer.state.get(p, {})}


def _init_all(strategy):
    for p in _trainable(strategy.optimizer):
        if p.requires_grad:
            strategy.optimizer.init_state(p)


def _zero_fragments(strategy):
    engine, base = strategy.engine, strategy.optimizer
    zero = engine.optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out, covered = [], set()
    if hasattr(zero, "fp32_partitioned_groups_flat"):  # stage 3
        for params, flat in zip(zero.fp16_groups, zero.fp32_partitioned_groups_flat):
            state = base.state.get(flat, {})
            for p in params:
                covered.add(id(p))
                _g, start, numel = zero.grad_position[zero.get_param_id(p)]
                rank = zero._get_param_partition_rank(p)
                real = max(0, min(numel, p.ds_numel - numel * rank))
                if not real:
                    continue
                offset = numel * rank
                out.append(Fragment(names[id(p)], MASTER, flat.narrow(0, start, real), offset))
                for field, value in state.items():
                    if field == STEP:
                        out.append(Fragment(names[id(p)], STEP, value, 0, offset == 0))
                    elif value.dim() == 1 and value.numel() == flat.numel():
                        out.append(Fragment(names[id(p)], field, value.narrow(0, start, real), offset))
        for name, p in engine.module.named_parameters():  # frozen: their own partition
            if id(p) in covered:
                continue
            numel = p.ds_tensor.numel()
            rank = zero._get_param_partition_rank(p)
            real = max(0, min(numel, p.ds_numel - numel * rank))
            if real:
                out.append(Fragment(name, MASTER, p.ds_tensor.view(-1).narrow(0, 0, real), numel * rank))
        return out
    if hasattr(zero, "single_partition_of_fp32_groups") or hasattr(zero, "fp32_groups_flat_partition"):
        if hasattr(zero, "single_partition_of_fp32_groups"):
            groups, flats = zero.bit16_groups, zero.single_partition_of_fp32_groups
        else:
            groups, flats = zero.bf16_groups, zero.fp32_groups_flat_partition
        for params, flat in zip(groups, flats):
            state = base.state.get(flat, {})
            for p in params:
                covered.add(id(p))
                m = p._hp_mapping
                if m is None:
                    continue
                hp, lp = m.hp_fragment_address, m.lp_fragment_address
                out.append(Fragment(names[id(p)], MASTER, flat.narrow(0, hp.start, hp.numel), lp.start))
                for field, value in state.items():
                    if field == STEP:
                        out.append(Fragment(names[id(p)], STEP, value, 0, lp.start == 0))
                    elif value.dim() == 1 and value.numel() == flat.numel():
                        out.append(Fragment(names[id(p)], field, value.narrow(0, hp.start, hp.numel), lp.start))
        frozen = [(n, p) for n, p in engine.module.named_parameters() if id(p) not in covered]
        out.extend(whole_tensor_fragments(frozen, None, strategy.rank == 0))
        return out
    return whole_tensor_fragments(engine.module.named_parameters(), base, strategy.rank == 0)


def _zero_prepare(strategy):
    for _params, flat in strategy.state_map.partitions():
        strategy.optimizer.init_state(flat)


def _zero_after(strategy):
    zero = strategy.engine.optimizer
    if hasattr(zero, "fp32_partitioned_groups_flat"):
        for sub in range(len(zero.fp32_partitioned_groups_flat)):
            zero._reassign_or_swap_out_partitioned_parameters(sub)
    elif hasattr(zero, "update_lp_params"):
        zero.update_lp_params()


def _zero_anchored(strategy):
    names = {id(p): n for n, p in strategy.engine.module.named_parameters()}
    return {names[id(p)] for params, flat in strategy.state_map.partitions()
            if "anchor" in strategy.optimizer.state.get(flat, {}) for p in params}


def install(strategy):
    from ft_framework.checkpointing import load_sharded, save_sharded

    def bind(name, fn):
        setattr(strategy, name, types.MethodType(fn, strategy))

    bind("checkpoint_params", lambda s: [param_info(n, p) for n, p in s.unwrapped_model().named_parameters()])
    if strategy.name == "deepspeed":
        bind("checkpoint_fragments", _zero_fragments)
        bind("prepare_checkpoint_load", _zero_prepare)
        bind("after_checkpoint_load", _zero_after)
        bind("anchored_parameter_names", _zero_anchored)
    elif strategy.name == "fsdp":
        bind("checkpoint_fragments", lambda s: dtensor_fragments(s.model.named_parameters(), s.optimizer, s.rank == 0))
        bind("prepare_checkpoint_load", _init_all)
        bind("anchored_parameter_names", _anchored_names_by_param)
    else:
        bind("checkpoint_fragments", lambda s: whole_tensor_fragments(
            s.unwrapped_model().named_parameters(), s.optimizer, s.rank == 0))
        bind("prepare_checkpoint_load", _init_all)
        bind("anchored_parameter_names", _anchored_names_by_param)
    bind("save_checkpoint", lambda s, d: save_sharded(d, s))
    bind("load_checkpoint", lambda s, d: load_sharded(d, s))
    return strategy


__all__ = ["install", "torch"]
