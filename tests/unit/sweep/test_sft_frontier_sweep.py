"""A sweep of tiny decoders (AdamW and RecAdam, 2 seeds each, a few steps of supervised fine-tuning)
and ft-report's learning–forgetting frontier on it: the decoder's axes (the KL from θ* and the LM
loss gained), a Spearman row for every forgetting measure, and the non-dominated points and
forgetting at matched accuracy of completion_loss, a lower-is-better metric, all checked against
the runs' own metrics.jsonl.

The runs go through ft-sweep's planning, store and index (run_sweep) with a runner that trains each
run in this process with the real Trainer, as the local runner's subprocess would: ft-train's
start-up (importing torch and transformers) would cost more than the four runs."""

from __future__ import annotations

import csv
import json

import pytest
import scipy.stats
import yaml

from sweep_helpers import dominated
from tiny_llm import build_tiny_llm_dir, write_sft_rows, write_sft_run_config
from tiny_run import InProcessRunner
from ft_framework.cli import report_main
from ft_framework.sweep import load_sweep, run_sweep

pytestmark = pytest.mark.slow   # four short runs: about 15 s on 2 cores
MEASURES = ("kl_from_pretrained", "lm_loss_gained", "cka_drift_last", "cka_drift_mean")


@pytest.fixture(scope="module")
def sft_sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft_sweep")
    model = build_tiny_llm_dir(tmp / "llama", "llama")
    files = write_sft_rows(tmp / "data", train_rows=32, eval_rows=8)
    write_sft_run_config(tmp / "base.yaml", model, tmp / "unused", files,
                         training={"max_steps": 4, "per_device_batch_size": 8, "seed": 1, "data_seed": None,
                                   "device": "cpu"},
                         evaluation={"num_evals": 2, "batch_size": 8, "forgetting": {"num_sentences": 6},
                                     "generation": {"samples": 0, "max_new_tokens": 1}})
    sweep = {"name": "sft_test", "base": "base.yaml", "output_dir": str(tmp / "store"),
             "axes": {"training.seed": [1, 2]},
             "methods": {"vanilla": {"set": {"optimizer": {"name": "adamw", "hparams": {"lr": 3.0e-3},
                                                           "weight_decay": 0.0}}},
                         "recadam": {"set": {}}},
             "interpolate": {"alphas": [0, 0.5, 1]}}   # WiSE-FT of every decoder run: its curve joins the frontier
    (tmp / "sweep.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    result = run_sweep(load_sweep(tmp / "sweep.yaml"), runner=InProcessRunner(), progress=False)
    assert result.complete and len(result.runs) == 4
    runs = {r.run_id: r for r in result.runs}
    evals = []   # every evaluation of every run, from its own metrics.jsonl
    for run_id, run in runs.items():
        for line in (result.store.run_dir(run_id) / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record.get("type") == "eval":
                evals.append({"method": run.method, "run_id": run_id, "step": record["step"],
                              "score": record["metrics"]["validation"]["completion_loss"],
                              "distance": record["forgetting_distance"], **record["forgetting"]})
    return tmp / "store", evals


def test_the_report_of_a_decoder_sweep_has_the_decoder_frontier(sft_sweep):
    store, evals = sft_sweep
    assert len(evals) == 8 and {e["method"] for e in evals} == {"vanilla", "recadam"}
    curves = {p.parent.name: json.loads(p.read_text()) for p in (store / "runs").glob("*/interpolation.json")}
    assert len(curves) == 4 and all([r["alpha"] for r in c["rows"]] == [0, 0.5, 1] for c in curves.values())
    assert report_main([str(store), "--bootstrap-samples", "100"]) == 0
    report = (store / "report.md").read_text()
    with open(store / "frontier.csv") as f:
        points = list(csv.DictReader(f))
    assert {p["measure"] for p in points} == {"kl_from_pretrained", "lm_loss_gained"}
    assert {p["task"] for p in points} == {"custom"}
    for measure in ("kl_from_pretrained", "lm_loss_gained"):
        mine = [p for p in points if p["measure"] == measure]
        # Every evaluation is a point, its score the completion loss as it is (lower is better).
        got = sorted((p["run_id"], int(p["step"]), float(p["score"]), float(p["forgetting"]), float(p["distance"]))
                     for p in mine if p["kind"] == "eval")
        want = sorted((e["run_id"], e["step"], e["score"], e[measure], e["distance"]) for e in evals)
        assert got == [pytest.approx(w) for w in want]
        # And every θ_α of every run's WiSE-FT curve but α = 1 (the run itself, an evaluation already),
        # as the run's own interpolation.json scored it: α = 0 is θ*, which forgot nothing.
        got = sorted((p["run_id"], float(p["alpha"]), float(p["score"]), float(p["forgetting"]))
                     for p in mine if p["kind"] == "interpolated")
        want = sorted((run_id, row["alpha"], row["metrics"]["validation"]["completion_loss"], row["forgetting"][measure])
                      for run_id, curve in curves.items() for row in curve["rows"] if row["alpha"] < 1)
        assert got == [pytest.approx(w) for w in want] and len(got) == 8
        assert all(abs(forgetting) < 1e-6 for _, alpha, _, forgetting in got if alpha == 0)
        # Non-dominated by the lower-is-better rule, point by point.
        pairs = [(float(p["score"]), float(p["forgetting"])) for p in mine]
        flags = [p["non_dominated"] == "True" for p in mine]
        assert flags == [not dominated(pair, pairs[:i] + pairs[i + 1:]) for i, pair in enumerate(pairs)]
        assert f"### custom: non-dominated points on {measure}" in report

    # Forgetting at matched accuracy: the target is vanilla's lowest loss / 0.99.
    target = min(e["score"] for e in evals if e["method"] == "vanilla") / 0.99
    with open(store / "matched_accuracy.csv") as f:
        matched = {(r["measure"], r["method"]): r for r in csv.DictReader(f)}
    for measure in ("kl_from_pretrained", "lm_loss_gained"):
        for method in ("vanilla", "recadam"):
            row = matched[(measure, method)]
            reaching = [e[measure] for e in evals if e["method"] == method and e["score"] <= target]
            assert float(row["target"]) == pytest.approx(target)
            assert int(row["reached"]) == len(reaching) and int(row["points"]) == 4
            assert (float(row["forgetting"]) if row["forgetting"] else None) == (
                pytest.approx(min(reaching)) if reaching else None)
        assert int(matched[(measure, "vanilla")]["reached"]) >= 1   # vanilla's best reaches its own target

    # Does ‖θ − θ*‖ predict it? One row per measure: all 8 points, then each method's 4.
    with open(store / "forgetting_correlation.csv") as f:
        rows = {(r["measure"], r["method"]): r for r in csv.DictReader(f)}
    assert {m for m, _ in rows} == set(MEASURES)
    for measure in MEASURES:
        for method in ("all", "vanilla", "recadam"):
            group = [e for e in evals if method in ("all", e["method"])]
            row = rows[(measure, method)]
            assert int(row["n"]) == len(group)
            ref = scipy.stats.spearmanr([e["distance"] for e in group], [e[measure] for e in group]).statistic
            assert float(row["rho"]) == pytest.approx(ref)
        assert f"| custom | {measure} | all | 8 |" in report

    # Table 1's best seed of a loss is the lowest; the plot has a panel per axis.
    assert "custom: completion_loss on validation, as is; lower is better" in report
    assert "| vanilla Best |" in report
    png = (store / "plots" / "frontier_custom.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
