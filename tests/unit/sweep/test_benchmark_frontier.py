"""The learning–forgetting frontier in the benchmarks' currency: a sweep of tiny decoders (AdamW,
RecAdam and LoRA, 2 seeds, each run scoring two small lm-eval tasks the test writes, and each
interpolated toward θ*) and ft-report's benchmark axis on it: the mean drop from θ*'s scores as a
forgetting axis beside the KL and the LM loss gained, one point per evaluation that scored the
benchmarks (RecAdam's without every_eval: its last only), the WiSE-FT α curve from the scores
ft-interpolate took at each α, the non-dominated points, the matched-accuracy table, and Spearman's
ρ of the drop against the KL, the LM loss gained and ‖θ − θ*‖ — all checked against the runs' own
metrics.jsonl and interpolation.json, the correlations against scipy on the same points."""

from __future__ import annotations

import csv
import json

import pytest
import scipy.stats
import yaml

from lm_eval_tasks import write_lm_eval_tasks
from tiny_run import InProcessRunner
from sweep_helpers import dominated
from tiny_llm import build_tiny_llm_dir, write_sft_rows, write_sft_run_config
from ft_framework.cli import report_main
from ft_framework.sweep import load_sweep, run_sweep

pytestmark = pytest.mark.slow   # six short runs, each scoring two tiny tasks 3 times and 3 more in its interpolation
DROP = "benchmark_forgetting"
PREDICTORS = ("kl_from_pretrained", "lm_loss_gained", "forgetting_distance")
ALPHAS = [0, 0.5, 1]


@pytest.fixture(scope="module")
def benchmark_sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("benchmark_sweep")
    model = build_tiny_llm_dir(tmp / "llama", "llama")
    files = write_sft_rows(tmp / "data", train_rows=32, eval_rows=8)
    # 40 items: the accuracy's drop moves in steps of 0.025, so the points' drops differ (Spearman below).
    mc, _, rolling = write_lm_eval_tasks(tmp / "tasks", rows=40)
    # The rolling task scored in bits per byte (its first metric; a random tiny model's word perplexity is ~1e13).
    bpb = tmp / "bpb" / "tiny_text_bpb.yaml"
    bpb.parent.mkdir()
    bpb.write_text(rolling.read_text().replace("task: tiny_text", "task: tiny_text_bpb")
                   .replace("  - metric: word_perplexity\n  - metric: byte_perplexity\n", ""))
    benchmarks = {"tasks": [{"path": str(mc)}, {"path": str(bpb), "limit": 5}], "every_eval": True, "batch_size": 4}
    write_sft_run_config(tmp / "base.yaml", model, tmp / "unused", files,
                         training={"max_steps": 4, "per_device_batch_size": 8, "seed": 1, "data_seed": None,
                                   "device": "cpu"},
                         evaluation={"num_evals": 2, "batch_size": 8, "forgetting": {"num_sentences": 6},
                                     "generation": {"samples": 0, "max_new_tokens": 1}, "benchmarks": benchmarks})
    adamw = {"name": "adamw", "hparams": {"lr": 3.0e-3}, "weight_decay": 0.0}
    sweep = {"name": "benchmark_test", "base": "base.yaml", "output_dir": str(tmp / "store"),
             "axes": {"training.seed": [1, 2]},
             "methods": {"vanilla": {"set": {"optimizer": adamw}},
                         # without every_eval: the benchmarks score its last evaluation only
                         "recadam": {"set": {"evaluation.benchmarks.every_eval": False}},
                         "lora": {"set": {"model.lora": {"r": 4, "alpha": 8, "dropout": 0.0},
                                          "optimizer": {**adamw, "hparams": {"lr": 1.0e-2}}}}},
             "interpolate": {"alphas": ALPHAS}}
    (tmp / "sweep.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    result = run_sweep(load_sweep(tmp / "sweep.yaml"), runner=InProcessRunner(), progress=False)
    assert result.complete and len(result.runs) == 6
    evals, curves = [], {}
    for run in result.runs:
        run_dir = result.store.run_dir(run.run_id)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record.get("type") == "eval":
                evals.append({"method": run.method, "run_id": run.run_id, "step": record["step"],
                              "score": record["metrics"]["validation"]["completion_loss"],
                              "forgetting_distance": record["forgetting_distance"], **record["forgetting"],
                              DROP: record.get(DROP), "benchmarks": record.get("benchmarks")})
        curves[run.run_id] = (run.method, json.loads((run_dir / "interpolation.json").read_text()))
    assert report_main([str(tmp / "store"), "--bootstrap-samples", "100"]) == 0
    return tmp / "store", evals, curves


def _csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_the_benchmark_drop_is_a_frontier_axis_with_its_alpha_curve(benchmark_sweep):
    store, evals, curves = benchmark_sweep
    # every_eval: each evaluation scored them; RecAdam without it: its last evaluation (step 4) only.
    scored = [e for e in evals if e[DROP] is not None]
    assert {(e["method"], e["step"]) for e in scored} == {("vanilla", 2), ("vanilla", 4), ("lora", 2), ("lora", 4),
                                                          ("recadam", 4)}
    # The mean drop is the accuracy's alone: bits per byte (lower is better) is another unit, reported only.
    assert len(scored) == 10 and all([s["rate"] for s in e["benchmarks"].values()] == [True, False] for e in scored)
    assert all(e[DROP] == pytest.approx(next(iter(e["benchmarks"].values()))["drop"]) for e in scored)
    assert len({e[DROP] for e in scored}) > 2
    points = _csv(store / "frontier.csv")
    assert {p["measure"] for p in points} == {"kl_from_pretrained", "lm_loss_gained", DROP}
    mine = [p for p in points if p["measure"] == DROP]
    got = sorted((p["run_id"], int(p["step"]), float(p["score"]), float(p["forgetting"]), float(p["distance"]))
                 for p in mine if p["kind"] == "eval")
    want = sorted((e["run_id"], e["step"], e["score"], e[DROP], e["forgetting_distance"]) for e in scored)
    assert got == [pytest.approx(w) for w in want]
    # WiSE-FT's α curve: ft-interpolate scored the benchmarks at each α against θ*'s scores the run kept;
    # θ_0 is θ* (no drop), θ_1 the run itself (an evaluation point already, not counted twice).
    for method, curve in curves.values():
        assert [r["alpha"] for r in curve["rows"]] == ALPHAS and len(curve["benchmarks_run"]["tasks"]) == 2
        assert [s["metric"] for s in curve["rows"][0]["benchmarks"].values()] == ["acc,none", "bits_per_byte,none"]
        assert all(abs(s["drop"]) < 1e-6 for s in curve["rows"][0]["benchmarks"].values())
        final = next(e for e in evals if e["run_id"] == curve["run_dir"].rsplit("/", 1)[-1] and e["step"] == 4)
        assert curve["rows"][-1][DROP] == pytest.approx(final[DROP], abs=1e-5)   # θ_1 scored as the run scored θ
    got = sorted((p["run_id"], float(p["alpha"]), float(p["score"]), float(p["forgetting"]))
                 for p in mine if p["kind"] == "interpolated")
    want = sorted((run_id, r["alpha"], r["metrics"]["validation"]["completion_loss"], r[DROP])
                  for run_id, (_, curve) in curves.items() for r in curve["rows"] if r["alpha"] < 1)
    assert got == [pytest.approx(w) for w in want] and len(got) == 12
    # Non-dominated by the lower-is-better rule, on this axis's points.
    pairs = [(float(p["score"]), float(p["forgetting"])) for p in mine]
    flags = [p["non_dominated"] == "True" for p in mine]
    assert flags == [not dominated(pair, pairs[:i] + pairs[i + 1:]) for i, pair in enumerate(pairs)]
    report = (store / "report.md").read_text()
    assert f"### custom: non-dominated points on {DROP}" in report
    assert "2 points without benchmark scores are left out of the benchmark_forgetting axis" in report


def test_forgetting_at_matched_accuracy_on_the_benchmark_axis(benchmark_sweep):
    store, evals, curves = benchmark_sweep
    # The target comes from every evaluation of vanilla (its best completion loss / 0.99), whichever scored benchmarks.
    target = min(e["score"] for e in evals if e["method"] == "vanilla") / 0.99
    rows = {r["method"]: r for r in _csv(store / "matched_accuracy.csv") if r["measure"] == DROP}
    assert set(rows) == {f"{m}{w}" for m in ("vanilla", "recadam", "lora") for w in ("", " + WiSE-FT")}
    for method in ("vanilla", "recadam", "lora"):
        own = [(e["score"], e[DROP]) for e in evals if e["method"] == method and e[DROP] is not None]
        alphas = [(r["metrics"]["validation"]["completion_loss"], r[DROP]) for m, c in curves.values() if m == method
                  for r in c["rows"] if r["alpha"] < 1]
        for label, candidates in ((method, own), (f"{method} + WiSE-FT", own + alphas)):
            row = rows[label]
            reaching = [drop for score, drop in candidates if score <= target]
            assert float(row["target"]) == pytest.approx(target)
            assert (int(row["reached"]), int(row["points"])) == (len(reaching), len(candidates))
            assert (float(row["forgetting"]) if row["forgetting"] else None) == (
                pytest.approx(min(reaching)) if reaching else None)
    assert int(rows["vanilla"]["reached"]) >= 1


def test_spearman_of_the_drop_against_the_kl_the_loss_gained_and_the_distance(benchmark_sweep):
    store, evals, _ = benchmark_sweep
    scored = [e for e in evals if e[DROP] is not None]
    rows = {(r["predictor"], r["method"]): r for r in _csv(store / "benchmark_correlation.csv")}
    # All 10 points, then vanilla's and LoRA's 4 each; RecAdam's 2 say nothing.
    assert set(rows) == {(p, m) for p in PREDICTORS for m in ("all", "vanilla", "lora")}
    for predictor in PREDICTORS:
        for method in ("all", "vanilla", "lora"):
            group = [e for e in scored if method in ("all", e["method"])]
            row = rows[(predictor, method)]
            ref = scipy.stats.spearmanr([e[predictor] for e in group], [e[DROP] for e in group])
            assert int(row["n"]) == len(group)
            assert float(row["rho"]) == pytest.approx(ref.statistic)
            if method == "all":   # 10 points: scipy's t approximation (exact p-values below 9 points)
                assert float(row["pvalue"]) == pytest.approx(ref.pvalue)
    report = (store / "report.md").read_text()
    assert "### Does the KL from θ* predict the benchmark drop? (RL's Razor)" in report
    assert "| custom | KL from θ* (kl_from_pretrained) | all | 10 |" in report
    # The distance table does not repeat the drop (its own table sets it against the distance).
    assert DROP not in {r["measure"] for r in _csv(store / "forgetting_correlation.csv")}


def test_the_figure_has_a_benchmark_panel(benchmark_sweep):
    store, _, _ = benchmark_sweep
    png = (store / "plots" / "frontier_custom.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 40_000


def test_an_interpolation_without_the_kept_scores_takes_theta_stars_from_theta_0(benchmark_sweep, tmp_path):
    """A run directory without benchmark_reference.json (removed here, from a copy): ft-interpolate
    scores θ_0 = θ* itself, which gives the scores the run kept, and the table shows the drop."""
    import shutil

    from ft_framework.interpolate import format_table, run_interpolation

    store, evals, curves = benchmark_sweep
    run_id = next(r for r, (method, _) in curves.items() if method == "vanilla")
    copy = tmp_path / run_id
    shutil.copytree(store / "runs" / run_id, copy)
    kept = json.loads((copy / "benchmark_reference.json").read_text())["scores"]
    (copy / "benchmark_reference.json").unlink()
    out = run_interpolation(copy, [0, 1], write=False)
    for row, want in zip(out["rows"], (curves[run_id][1]["rows"][0], curves[run_id][1]["rows"][-1])):
        assert row[DROP] == pytest.approx(want[DROP], abs=1e-6)
        for name, score in row["benchmarks"].items():
            assert score["theta_star"] == pytest.approx(kept[name]["score"], abs=1e-6)
    assert out["rows"][0][DROP] == 0.0
    header = format_table(out).splitlines()[0]
    assert header.split()[-1] == DROP
