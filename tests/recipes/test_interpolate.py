"""ft-interpolate on real runs of the tiny BERT: α = 1 gives the run's own metrics, α = 0 the
pretrained encoder under the fine-tuned head (evaluated independently, by the trainer), the
distance at α = 1 is the run's logged ‖θ − θ*‖, θ* from the checkpoint's anchors equals θ* from
the pretrained model, and under RI θ* is still the pretrained model."""

import json
from pathlib import Path

import pytest
import torch

from tiny_run import write_run_config
from ft_framework.cli import interpolate_main
from ft_framework.config import load_config
from ft_framework.interpolate import interpolate_state, load_run, run_interpolation
from ft_framework.trainer import Trainer


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def finished_run(tiny_bert_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("interp")
    cfg = write_run_config(root / "run.yaml", tiny_bert_dir, root / "out", training={"max_steps": 12},
                           data={"max_train_examples": 32},
                           optimizer={"name": "adamw", "hparams": {"lr": 5e-3}},
                           checkpoint={"every_steps": 12, "export_dir": str(root / "out" / "export")})
    results = Trainer(load_config(cfg)).fit()
    return root, results


def test_alpha_one_is_the_run_and_alpha_zero_the_pretrained_encoder(finished_run, tiny_bert_dir, capsys):
    root, results = finished_run
    run_dir = root / "out"
    assert interpolate_main([str(run_dir), "--alphas", "0,0.5,1"]) == 0
    printed = capsys.readouterr().out
    assert "||theta_a - theta*||" in printed and "best accuracy on validation" in printed
    assert "cka_drift_last" in printed
    out = json.loads((run_dir / "interpolation.json").read_text())
    assert (run_dir / "interpolation.png").stat().st_size > 0
    assert out["theta_source"].startswith("export")
    rows = {r["alpha"]: r for r in out["rows"]}
    assert rows[1.0]["metrics"] == results["final"]["metrics"]
    last = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["type"] == "train"][-1]
    assert rows[1.0]["distance"] == pytest.approx(last["forgetting_distance"], rel=1e-5)
    assert rows[0.5]["distance"] == pytest.approx(rows[1.0]["distance"] / 2)
    assert rows[0.0]["distance"] == 0.0
    # Functional forgetting for every α: none at θ*, the run's own final value at α = 1.
    assert rows[0.0]["forgetting"]["cka_drift_last"] == pytest.approx(0.0, abs=1e-9)
    assert rows[1.0]["forgetting"] == pytest.approx(results["final"]["forgetting"], rel=1e-6)
    assert 0 < rows[0.5]["forgetting"]["cka_drift_mean"] < rows[1.0]["forgetting"]["cka_drift_mean"]

    # α = 0 by hand: the pretrained encoder with the run's head, scored by the trainer itself.
    cfg, _ = load_run(run_dir)
    trainer = Trainer(cfg.model_copy(update={"logging": cfg.logging.model_copy(
        update={"output_dir": str(root / "alpha0")}), "checkpoint": cfg.checkpoint.model_copy(update={"export_dir": None})}))
    trainer.setup()
    from transformers import AutoModelForSequenceClassification

    tuned = AutoModelForSequenceClassification.from_pretrained(run_dir / "export").state_dict()
    pretrained = AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir).state_dict()
    by_hand = {n: (tuned[n] if n.startswith("classifier.") else pretrained[n]) for n in tuned}
    trainer.strategy.unwrapped_model().load_state_dict(by_hand)
    assert trainer.evaluate() == rows[0.0]["metrics"]


def test_checkpoint_path_and_anchors_give_the_same_curve(finished_run, tmp_path):
    root, results = finished_run
    run_dir = root / "out"
    saved = json.loads((run_dir / "results.json").read_text())
    # Without the export, θ comes from the final checkpoint; θ* from the anchors saved in it or
    # from the pretrained model: the same tensors, so the same numbers.
    results_no_export = {**saved}
    results_no_export.pop("exported_to")
    (run_dir / "results.json").write_text(json.dumps(results_no_export))
    try:
        anchors = run_interpolation(run_dir, [0.0, 0.3, 1.0], theta_star="anchors", write=False)
        pretrained = run_interpolation(run_dir, [0.0, 0.3, 1.0], theta_star="pretrained", write=False)
    finally:
        (run_dir / "results.json").write_text(json.dumps(saved))
    assert "checkpoints" in anchors["theta_source"] and anchors["theta_star_source"].startswith("anchors")
    assert pretrained["theta_star_source"].startswith("pretrained")
    assert anchors["rows"] == pretrained["rows"]
    assert anchors["rows"][-1]["metrics"] == results["final"]["metrics"]


def test_under_ri_theta_star_is_the_pretrained_model(tiny_bert_dir, tmp_path):
    cfg = write_run_config(tmp_path / "ri.yaml", tiny_bert_dir, tmp_path / "ri", training={"max_steps": 3},
                           model={"init": "random"}, evaluation={"num_evals": 1},
                           checkpoint={"every_steps": 3})
    results = Trainer(load_config(cfg)).fit()
    out = run_interpolation(tmp_path / "ri", [0.0, 1.0], write=False)
    # RecAdam's anchors under RI are the pretrained weights, not the re-initialized start.
    assert out["theta_star_source"].startswith("anchors")
    assert out["rows"][-1]["metrics"] == results["final"]["metrics"]
    from ft_framework.checkpointing.run_weights import anchors_from_checkpoint
    from transformers import AutoModelForSequenceClassification

    ckpt = tmp_path / "ri" / "checkpoints" / "step_00000003"
    anchors = anchors_from_checkpoint(ckpt)
    pretrained = AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir).state_dict()
    assert set(anchors) == {n for n in pretrained if not n.startswith("classifier.")
                            and n in dict(AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir).named_parameters())}
    for name, value in anchors.items():
        assert torch.equal(value, pretrained[name]), name
    from ft_framework.checkpointing.run_weights import checkpoint_model_state

    theta = checkpoint_model_state(ckpt)[0]   # whatever layout the strategy wrote
    at_zero = interpolate_state(theta, anchors, 0.0)
    assert all(torch.equal(at_zero[n], pretrained[n]) for n in anchors)
    assert torch.equal(at_zero["classifier.weight"], theta["classifier.weight"])


def test_a_run_without_saved_weights_is_a_clear_error(tiny_bert_dir, tmp_path):
    cfg = write_run_config(tmp_path / "r.yaml", tiny_bert_dir, tmp_path / "r", training={"max_steps": 2},
                           evaluation={"num_evals": 1})
    Trainer(load_config(cfg)).fit()
    assert interpolate_main([str(tmp_path / "r")]) == 2


def test_select_best_interpolates_from_the_best_checkpoint(tiny_bert_dir, tmp_path):
    # No export and no periodic checkpoint: θ is read from checkpoints/best (the sharded layout),
    # so α = 1 scores exactly the best evaluation, and θ* comes from the anchors saved in it.
    cfg = write_run_config(tmp_path / "b.yaml", tiny_bert_dir, tmp_path / "b", training={"max_steps": 6},
                           data={"max_train_examples": 16}, evaluation={"num_evals": 3, "select_best": True},
                           optimizer={"name": "adamw", "hparams": {"lr": 5e-3}})
    results = Trainer(load_config(cfg)).fit()
    assert results["reported"] == "best"
    out = run_interpolation(tmp_path / "b", [0.0, 1.0], write=False)
    assert out["theta_source"] == str(tmp_path / "b" / "checkpoints" / "best")
    assert out["theta_star_source"].startswith("anchors")
    assert out["rows"][-1]["metrics"] == results["best"]["metrics"]


def test_a_run_with_evaluation_interpolation_interpolates_itself_at_its_end(tiny_bert_dir, tmp_path, capsys):
    """ft-train with evaluation.interpolation: interpolation.json is written by the run's own process
    after results.json, with the configured α, and α = 1 is the run's reported model."""
    from ft_framework.cli import train_main

    cfg = write_run_config(tmp_path / "r.yaml", tiny_bert_dir, tmp_path / "r", training={"max_steps": 3},
                           data={"max_train_examples": 16}, evaluation={"num_evals": 1,
                                                                        "interpolation": {"alphas": [1, 0, 0.5]}},
                           checkpoint={"export_dir": str(tmp_path / "r" / "export")})
    assert train_main(["--config", str(cfg)]) == 0
    printed = capsys.readouterr().out
    assert "||theta_a - theta*||" in printed and f"wrote {tmp_path / 'r'}/interpolation.json" in printed
    results = json.loads((tmp_path / "r" / "results.json").read_text())
    assert results["config"]["evaluation"]["interpolation"] == {"alphas": [0.0, 0.5, 1.0], "theta_star": "auto"}
    out = json.loads((tmp_path / "r" / "interpolation.json").read_text())
    assert out["alphas"] == [0.0, 0.5, 1.0] and out["theta_source"].startswith("export")
    assert out["rows"][-1]["metrics"] == results["final"]["metrics"]
    assert (tmp_path / "r" / "interpolation.json").stat().st_mtime >= (tmp_path / "r" / "results.json").stat().st_mtime


def test_a_failed_interpolation_at_the_end_leaves_the_run_finished_and_says_so_in_one_line(tiny_bert_dir, tmp_path,
                                                                                         capsys):
    # θ* from the anchors, but θ comes from the export, which holds none: the interpolation is refused.
    from ft_framework.cli import train_main

    cfg = write_run_config(tmp_path / "r.yaml", tiny_bert_dir, tmp_path / "r", training={"max_steps": 2},
                           data={"max_train_examples": 16},
                           evaluation={"num_evals": 1, "interpolation": {"alphas": [0, 1], "theta_star": "anchors"}},
                           checkpoint={"export_dir": str(tmp_path / "r" / "export")})
    assert train_main(["--config", str(cfg)]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("ft-train:")]
    assert len(lines) == 1 and "interpolation toward theta* failed" in lines[0] and "Traceback" not in err
    assert f"ft-interpolate {tmp_path / 'r'} tries again" in lines[0]
    results = json.loads((tmp_path / "r" / "results.json").read_text())
    assert "status" not in results and results["steps"] == 2   # finished (an interrupted run says so)
    assert not (tmp_path / "r" / "interpolation.json").exists()


def test_evaluation_interpolation_without_saved_final_weights_is_refused_before_the_run(tiny_bert_dir, tmp_path,
                                                                                       capsys):
    from ft_framework.cli import train_main

    cfg = write_run_config(tmp_path / "r.yaml", tiny_bert_dir, tmp_path / "r", training={"max_steps": 2},
                           evaluation={"num_evals": 1, "interpolation": {}})
    assert train_main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "evaluation.interpolation needs the run's final weights saved" in err[0]
    assert "checkpoint.export_dir" in err[0] and not (tmp_path / "r" / "results.json").exists()
    bad = write_run_config(tmp_path / "b.yaml", tiny_bert_dir, tmp_path / "b",
                           evaluation={"interpolation": {"alphas": [0, 2]}},
                           checkpoint={"export_dir": str(tmp_path / "b" / "export")})
    assert train_main(["--config", str(bad)]) == 2
    assert "alphas must be a non-empty list of values in [0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("source", ["export", "final checkpoint"])
def test_a_decoders_sft_run_is_interpolated_through_its_task_kind(tmp_path, capsys, source):
    """WiSE-FT for a decoder: exact match, completion loss, the LM loss gained and the KL from θ* at
    each α; α = 0 is the pretrained decoder (the run's baseline, no forgetting), α = 1 the run's
    final evaluation, to 1e-6. The tiny Llama ties its output embedding to its input embedding (one
    tensor, two names): both names get the same θ_α, or α = 1 would not be the run."""
    from tiny_llm import build_tiny_llm_dir, write_sft_rows, write_sft_run_config

    model = build_tiny_llm_dir(tmp_path / "llama", "llama")
    files = write_sft_rows(tmp_path / "data")
    saved = ({"export_dir": str(tmp_path / "run" / "export")} if source == "export" else {"every_steps": 6})
    config = write_sft_run_config(tmp_path / "run.yaml", model, tmp_path / "run", files,
                                  data={"main_metric": "exact_match"}, training={"max_steps": 6},
                                  optimizer={"name": "adamw", "hparams": {"lr": 1e-2}}, checkpoint=saved)
    results = Trainer(load_config(config)).fit()
    assert interpolate_main([str(tmp_path / "run"), "--alphas", "0,0.5,1"]) == 0
    printed = capsys.readouterr().out
    for column in ("validation/exact_match", "validation/completion_loss", "lm_loss_gained", "kl_from_pretrained"):
        assert column in printed, column
    out = json.loads((tmp_path / "run" / "interpolation.json").read_text())
    assert out["theta_source"].startswith("export" if source == "export" else str(tmp_path / "run" / "checkpoints"))
    rows = {r["alpha"]: r for r in out["rows"]}
    final, baseline = results["final"], results["baseline"]["metrics"]
    assert rows[1.0]["metrics"] == {s: pytest.approx(m, rel=1e-6, abs=1e-9) for s, m in final["metrics"].items()}
    assert rows[0.0]["metrics"] == {s: pytest.approx(m, rel=1e-6, abs=1e-9) for s, m in baseline.items()}
    assert rows[1.0]["forgetting"] == pytest.approx(final["forgetting"], rel=1e-6, abs=1e-9)
    assert rows[0.0]["forgetting"]["kl_from_pretrained"] == pytest.approx(0.0, abs=1e-7)
    assert rows[0.0]["forgetting"]["lm_loss_gained"] == pytest.approx(0.0, abs=1e-6)
    assert 0 < rows[0.5]["forgetting"]["kl_from_pretrained"] < rows[1.0]["forgetting"]["kl_from_pretrained"]
    assert final["metrics"]["validation"]["completion_loss"] < baseline["validation"]["completion_loss"]
