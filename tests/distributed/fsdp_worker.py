"""Runs every FSDP case of tests/distributed/test_fsdp.py and writes what it measured to files; the
pytest side compares them. The steps of its plan, in this order, each its ranks forked from this
one process (tests/distributed/rank_launcher.py: a launch costs far more than a case):

    one    (1 rank):  the plain single-process reference (SingleDeviceStrategy) and a 1-rank FSDP
                      run that saves a checkpoint after step 3
    two    (2 ranks): FSDP2 and FSDP2 + CPU offload (straight run, save/resume, 1 -> 2 resume, Mixout,
                      bad checkpoints, mixed precision, loss scaler, consolidated export)
    three  (1 rank):  2 -> 1 resume of step two's checkpoint

    python tests/distributed/fsdp_worker.py PLAN     (each step with out=OUT_DIR)
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from transformers import AlbertForSequenceClassification  # noqa: F401 - imported once, for every forked rank

from fsdp_helpers import (MAX_GRAD_NORM, RESUME_AT, STEPS, global_batches, make_optimizer_builder,
                          pretrained_state, rank_slice, tiny_albert)

from ft_framework.config import FSDPConfig
from ft_framework.models.activation_checkpointing import apply_activation_checkpointing, checkpointed_blocks
from ft_framework.models.loading import MixoutLinear, apply_mixout
from ft_framework.optim.base import local_tensor
from ft_framework.strategies import SingleDeviceStrategy
from ft_framework.strategies.fsdp import FSDPStrategy, _ShardedLossScaler
from rank_launcher import run_plan


MIXOUT_P = 0.3
MIXOUT_STEPS = 2


def fsdp_strategy(offload=False, mixed_precision=False, precision="fp32"):
    return FSDPStrategy(FSDPConfig(cpu_offload=offload, mixed_precision=mixed_precision),
                        SimpleNamespace(precision=precision, device="cpu"))


def set_up(strategy, mixout=0.0, dropout=0.0, checkpointing=False, **opt_kw):
    model = tiny_albert(dropout)
    pre = pretrained_state(model)
    if mixout:
        apply_mixout(model, mixout, pre)
    if checkpointing:  # before fully_shard, as the trainer does
        apply_activation_checkpointing(model)
    # The strategy keeps (a shard of) the tensors it is given: hand it copies, the test keeps `pre`.
    strategy.setup(model, make_optimizer_builder(pre, **opt_kw),
                   anchors={n: t.clone() for n, t in pre.items()})
    return pre


def train_steps(strategy, steps, log=None):
    """Optimizer steps `steps` (0-based indices into the global batches) on this rank's half."""
    batches = global_batches()
    for i in steps:
        torch.manual_seed(100 + i)  # Mixout's masks: the same draws on every rank and in one process
        strategy.model.train()
        batch = rank_slice(batches[i], strategy.rank, strategy.world_size)
        loss = strategy.forward(batch).loss
        strategy.backward(loss)
        norm = strategy.clip_and_step(MAX_GRAD_NORM)
        if log is not None:
            log.setdefault("grad_norm", []).append(norm)
            log.setdefault("forgetting", []).append(strategy.forgetting_distance())
            log.setdefault("loss", []).append(float(loss.detach()))


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def full_params(strategy):
    """Collective: every parameter's full value (through the strategy's own gather)."""
    names = {n for n, _ in strategy.model.named_parameters()}
    return {k: v for k, v in strategy.full_state_dict().items() if k in names}


def full_opt_state(strategy):
    """Collective: {param name: {state key: full tensor}} (anchor, exp_avg, exp_avg_sq, step)."""
    out = {}
    for name, p in strategy.model.named_parameters():
        out[name] = {k: full(v) for k, v in sorted(strategy.optimizer.state.get(p, {}).items())}
    return out


def local_anchor_numel(strategy):
    return sum(local_tensor(s["anchor"]).numel() for s in strategy.optimizer.state.values() if "anchor" in s)


class Results:
    def __init__(self, out: Path, phase: str, rank: int):
        self.path = out / f"results_{phase}.pt"
        self.rank = rank
        self.data = {}

    def __setitem__(self, key, value):
        self.data[key] = value

    def write(self):
        if self.rank == 0:
            tmp = self.path.with_suffix(".tmp")
            torch.save(self.data, tmp)
            tmp.replace(self.path)


# ---- phases ---------------------------------------------------------------------------------
def phase_one(out: Path, res: Results):
    # The plain single-process reference: whole global batches, no FSDP.
    ref = SingleDeviceStrategy("fp32", "cpu")
    pre = set_up(ref)
    log = {}
    train_steps(ref, range(RESUME_AT), log)
    res["ref_state_3"] = {n: {k: v.clone() for k, v in ref.optimizer.state[p].items()}
                          for n, p in ref.model.named_parameters()}
    train_steps(ref, range(RESUME_AT, STEPS), log)
    res["pretrained"] = pre
    res["ref_params_5"] = {n: p.detach().clone() for n, p in ref.model.named_parameters()}
    res["ref_log"] = log
    res["ref_impl"] = ref.optimizer.impl

    # Mixout (mixing toward theta*) in one process, the reference for the sharded run.
    ref = SingleDeviceStrategy("fp32", "cpu")
    set_up(ref, mixout=MIXOUT_P)
    train_steps(ref, range(MIXOUT_STEPS))
    res["mixout_ref_params"] = {n: p.detach().clone() for n, p in ref.model.named_parameters()}
    plain = SingleDeviceStrategy("fp32", "cpu")  # the same steps without Mixout: it must matter
    set_up(plain)
    train_steps(plain, range(MIXOUT_STEPS))
    res["mixout_plain_params"] = {n: p.detach().clone() for n, p in plain.model.named_parameters()}

    # FSDP on one rank: 3 steps, checkpoint (for the 1 -> 2 resume), 2 more steps.
    s = fsdp_strategy()
    set_up(s)
    log = {}
    train_steps(s, range(RESUME_AT), log)
    ck = out / "ck_1rank"
    ck.mkdir(exist_ok=True)
    s.save_checkpoint(ck)
    res["fsdp1_state_3"] = full_opt_state(s)
    train_steps(s, range(RESUME_AT, STEPS), log)
    res["fsdp1_params_5"] = full_params(s)
    res["fsdp1_log"] = log
    res["fsdp1_impl"] = s.optimizer.impl


def resume_from(ck: Path, offload=False):
    """A new model/optimizer/strategy loading `ck`: (state right after loading, params 2 steps later)."""
    s = fsdp_strategy(offload)
    set_up(s)
    s.load_checkpoint(ck)
    state = full_opt_state(s)
    params_at_load = full_params(s)
    train_steps(s, range(RESUME_AT, STEPS))
    return s, state, params_at_load, full_params(s)


def bad_checkpoints(s, out: Path, res: Results, tag: str):
    """Checkpoints without anchors / with a mis-shaped anchor are refused with a clear error: one
    parameter's anchor left out of / mis-sized in a saved checkpoint's DCP .metadata."""
    victim = "param/albert.encoder.embedding_hidden_mapping_in.weight/anchor"
    base = out / f"ck_base_{tag}"
    if s.rank == 0:
        base.mkdir(exist_ok=True)
    s.barrier()
    s.save_checkpoint(base)
    edits = {"no_anchor": lambda md: md.pop(victim),
             "bad_shape": lambda md: md.__setitem__(victim, dataclasses.replace(md[victim], size=torch.Size([15])))}
    for name, edit in edits.items():
        ck = out / f"ck_{name}_{tag}"
        if s.rank == 0:
            shutil.copytree(base, ck, dirs_exist_ok=True)
            metadata = pickle.loads((ck / ".metadata").read_bytes())
            edit(metadata.state_dict_metadata)
            (ck / ".metadata").write_bytes(pickle.dumps(metadata))
        s.barrier()
        fresh = fsdp_strategy(s.cpu_offload)
        set_up(fresh)
        before = full_opt_state(fresh)
        try:
            fresh.load_checkpoint(ck)
            res[f"error_{name}_{tag}"] = None
        except Exception as exc:  # noqa: BLE001 - the message is what the test checks
            res[f"error_{name}_{tag}"] = f"{type(exc).__name__}: {exc}"
        after = full_opt_state(fresh)
        res[f"error_{name}_{tag}_state_untouched"] = all(
            torch.equal(before[n][k], after[n][k]) for n in before for k in before[n])


def phase_two(out: Path, res: Results):
    for offload in (False, True):
        tag = "offload" if offload else "plain"
        s = fsdp_strategy(offload)
        pre = set_up(s)
        res[f"{tag}_dtensor_params"] = all(hasattr(p, "device_mesh") for p in s.model.parameters())
        res[f"{tag}_sharded_modules"] = s.sharded_module_names
        res[f"{tag}_anchors_at_setup"] = {n: full(s.optimizer.state[p]["anchor"])
                                          for n, p in s.model.named_parameters() if n in pre}
        log = {}
        train_steps(s, range(RESUME_AT), log)
        ck = out / f"ck_2rank_{tag}"
        if s.is_main_process:
            ck.mkdir(exist_ok=True)
        s.barrier()
        s.save_checkpoint(ck)
        res[f"{tag}_state_3"] = full_opt_state(s)
        train_steps(s, range(RESUME_AT, STEPS), log)
        res[f"{tag}_params_5"] = full_params(s)
        res[f"{tag}_log"] = log
        res[f"{tag}_impl"] = s.optimizer.impl
        res[f"{tag}_anchors_5"] = {n: v["anchor"] for n, v in full_opt_state(s).items() if "anchor" in v}
        res[f"{tag}_local_anchor_numel"] = s.gather_objects(local_anchor_numel(s))
        res[f"{tag}_local_param_device"] = s.gather_objects(
            sorted({str(local_tensor(p).device) for p in s.model.parameters()}))
        res[f"{tag}_local_state_device"] = s.gather_objects(
            sorted({str(local_tensor(v).device) for st in s.optimizer.state.values() for v in st.values()
                    if v.dim() > 0}))

        # Resume on the same number of ranks equals the uninterrupted run.
        _, state, _, params = resume_from(ck, offload)
        res[f"{tag}_resumed_state_3"] = state
        res[f"{tag}_resumed_params_5"] = params

        bad_checkpoints(s, out, res, tag)

    # 1 -> 2: step one's 1-rank checkpoint.
    _, state, _, params = resume_from(out / "ck_1rank")
    res["from1_state_3"] = state
    res["from1_params_5"] = params

    # Mixout under FSDP2: each MixoutLinear reads the sharded anchor (gathered in its forward)
    # instead of keeping a full copy of theta*, and training equals the one-process run.
    s = fsdp_strategy()
    set_up(s, mixout=MIXOUT_P)
    mixouts = {n: m for n, m in s.model.named_modules() if isinstance(m, MixoutLinear)}
    res["mixout_modules"] = sorted(mixouts)
    res["mixout_buffers_dropped"] = all(m.target is None for m in mixouts.values())
    res["mixout_target_local_numel"] = s.gather_objects(
        {n: (local_tensor(m.target_tensor()).numel(), m.weight.numel()) for n, m in mixouts.items()})
    train_steps(s, range(MIXOUT_STEPS))
    res["mixout_params"] = full_params(s)

    # Activation checkpointing: the same weights as without it, dropout and Mixout on.
    for checkpointing in (False, True):
        tag = "checkpointed" if checkpointing else "plain"
        s = fsdp_strategy()
        set_up(s, mixout=MIXOUT_P, dropout=0.1, checkpointing=checkpointing)
        calls = []
        s.model.albert.encoder.albert_layer_groups[0].albert_layers[0].ffn.register_forward_hook(
            lambda *_: calls.append(1))
        train_steps(s, range(MIXOUT_STEPS))
        res[f"ac_{tag}_params"] = full_params(s)
        res[f"ac_{tag}_blocks"] = len(checkpointed_blocks(s.model))
        res[f"ac_{tag}_inner_calls"] = len(calls)

    # Mixed precision (bf16 compute, fp32 sharded master weights): theta* stays exact.
    s = fsdp_strategy(mixed_precision=True, precision="bf16")
    pre = set_up(s)
    seen = []
    layer = s.model.albert.encoder.embedding_hidden_mapping_in
    hook = layer.register_forward_hook(lambda m, i, o: seen.append((str(m.weight.dtype), str(o.dtype))))
    log = {}
    train_steps(s, range(2), log)
    hook.remove()
    res["mp_compute_dtypes"] = seen
    res["mp_sharded_param_dtypes"] = sorted({str(p.dtype) for p in s.model.parameters()})
    res["mp_grad_free_after_step"] = all(p.grad is None for p in s.model.parameters())
    res["mp_anchors"] = {n: v["anchor"] for n, v in full_opt_state(s).items() if "anchor" in v}
    res["mp_log"] = log
    res["mp_impl"] = s.optimizer.impl

    # The same with the compact state: the fp32 shards FSDP2 keeps are anchor + delta, beside bf16
    # moments and a bf16 theta*, while the forward and backward compute in bf16.
    s = fsdp_strategy(mixed_precision=True, precision="bf16")
    set_up(s, state_dtype="bfloat16", anchor_dtype="bfloat16", rounding_seed=11)
    log = {}
    train_steps(s, range(2), log)
    res["mp_compact_state"] = {n: v for n, v in full_opt_state(s).items() if v}
    res["mp_compact_params"] = full_params(s)
    res["mp_compact_log"] = log

    # The fp16 loss scaler's skip logic (exercised in fp32 on CPU): an inf on one rank's shard makes
    # every rank skip the step and halve the scale; the next step goes through.
    s = fsdp_strategy()
    set_up(s)
    s.scaler = _ShardedLossScaler(init_scale=1024.0)
    before = full_params(s)
    batch = rank_slice(global_batches()[0], s.rank, s.world_size)
    s.backward(s.forward(batch).loss)
    if s.rank == 1:
        local_tensor(next(p for p in s.model.parameters() if p.grad is not None).grad).view(-1)[0] = float("inf")
    norm = s.clip_and_step(MAX_GRAD_NORM)
    unchanged = all(torch.equal(before[n], v) for n, v in full_params(s).items())
    res["scaler_skip"] = s.gather_objects({"norm": norm, "scale": s.scaler.scale, "unchanged": unchanged})
    s.backward(s.forward(batch).loss)
    norm = s.clip_and_step(MAX_GRAD_NORM)
    res["scaler_next"] = {"norm": norm, "changed": any(not torch.equal(before[n], v)
                                                        for n, v in full_params(s).items())}
    # The scaler's state travels with the DCP checkpoint.
    ck = out / "ck_scaler"
    if s.is_main_process:
        ck.mkdir(exist_ok=True)
    s.barrier()
    s.save_checkpoint(ck)
    fresh = fsdp_strategy()
    set_up(fresh)
    fresh.scaler = _ShardedLossScaler(init_scale=1024.0)
    fresh.load_checkpoint(ck)
    res["scaler_loaded"] = fresh.gather_objects(fresh.scaler.state_dict())


def phase_three(out: Path, res: Results):
    # 2 -> 1: step two's checkpoint on one rank.
    _, state, _, params = resume_from(out / "ck_2rank_plain")
    res["from2_state_3"] = state
    res["from2_params_5"] = params


PHASES = {"one": phase_one, "two": phase_two, "three": phase_three}  # the test's plan: in this order


def run(phase: str, out: str):
    """Step `phase` on this rank; rank 0 writes OUT_DIR/results_<phase>.pt."""
    out = Path(out)
    probe = fsdp_strategy()  # initializes the process group
    res = Results(out, phase, probe.rank)
    res["world_size"] = probe.world_size
    PHASES[phase](out, res)
    res.write()
    dist.barrier()
    probe.close()


def main():
    torch.set_num_threads(1)
    run_plan({phase: functools.partial(run, phase) for phase in PHASES})


if __name__ == "__main__":
    main()
