"""CPU checks of the GPU suite's own code (NOT marked gpu: they run on CI): benchmarks/gpu_suite.py
imports, parses its arguments, formats its tables and searches batch sizes; the GPU tests' skip
reasons and run config are sound; the GPU worker runs one case end to end on the CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpu_common import CASES, REPO, case_params, run_config, skip_reason, write_config


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arguments_parse_and_resolve():
    suite = load_benchmark("gpu_suite")
    args = suite.resolve_defaults(suite.build_parser().parse_args(["--only", "c,tests", "--tiny", "--out", "x.md"]))
    assert args.only == ["tests", "c"] and args.tiny and args.out == "x.md"
    assert (args.a_params, args.a_tensors, args.batch, args.seq) == (2e6, 10, 4, 16)
    full = suite.resolve_defaults(suite.build_parser().parse_args([]))
    assert full.only == ["tests", "a", "b", "c", "d", "e", "f"] and full.a_params == 200e6 and full.a_tensors == 100
    assert (full.batch, full.seq, full.cap_gb) == (32, 128, 16.0)
    with pytest.raises(SystemExit):
        suite.build_parser().parse_args(["--only", "a,z"])


def test_chunk_sizes_and_batch_search():
    suite = load_benchmark("gpu_suite")
    sizes = suite.chunk_sizes(200e6 + 7, 100)
    assert len(sizes) == 100 and sum(sizes) == int(200e6 + 7) and max(sizes) - min(sizes) <= 1
    for limit in (1, 2, 31, 32, 33, 37, 100):
        largest, probes = suite.largest_fitting_batch(lambda b: b <= limit, 32, 1024)
        assert largest == limit, (limit, probes)
        assert len(probes) <= 2 * 11
    assert suite.largest_fitting_batch(lambda b: False, 32, 1024)[0] is None
    assert suite.largest_fitting_batch(lambda b: True, 32, 100)[0] == 100


def test_tables_and_report_format():
    suite = load_benchmark("gpu_suite")
    table = suite.markdown_table(["a", "b"], [[1, "x|y"], [None, 2.5]])
    lines = table.splitlines()
    assert lines[0].startswith("| a") and set(lines[1]) <= {"|", "-"} and "x\\|y" in lines[2]
    a = {"numel": 200_000_000, "tensors": 100, "device": "NVIDIA H100", "steps": 20, "warmup": 5,
         "timer": "CUDA events", "candidates": [
             {"name": "RecAdam (ours, impl=torch)", "median_ms": 12.0, "min_ms": 11.0, "note": ""},
             {"name": "torch AdamW fused", "median_ms": 10.0, "min_ms": 9.5},
             {"name": "RecAdam, torch.compile(lambda: opt.step())", "note": "not timed: recompiles"}]}
    text = suite.format_a(a)
    assert "1.20x" in text and "meets the 1.5x target" in text and "not timed" in text
    b = {"model": "ALBERT-xxlarge", "numel": 222.6e6, "seq": 128, "batch": 32, "world_size": 1, "backend": "nccl",
         "steps": 8, "warmup": 3, "candidates": [
             {"name": "RecAdam (ours)", "impl": "cpu", "batch": 32, "iter_ms": 900.0, "step_ms": 500.0,
              "cpu_step_ms": 400.0, "cpu_share": 0.44, "samples_per_s": 35.5, "peak_gpu_gb": 9.1},
             {"name": "DeepSpeedCPUAdam", "error": "RuntimeError: no nvcc", "iter_ms": None}]}
    cap = {"cap_gb": 16, "seq": 128, "max_batch": 1024, "candidates": b["candidates"], "largest_batch": 96,
           "probes": [(32, True), (64, True), (128, False), (96, True)]}
    text = suite.format_b(b, cap)
    assert "44.0%" in text and "no nvcc" in text and "**96**" in text and "128 OOM" in text
    c = {"DeepSpeed ZeRO-2": {"model": "ALBERT-xxlarge", "numel": 222.6e6, "seq": 128, "batch": 32,
                              "precision": "bf16", "backend": "nccl", "steps": 8, "candidates": [
                                  {"name": "RecAdam (ours)", "iter_ms": 300.0, "samples_per_s": 106.7},
                                  {"name": "torch AdamW fused", "iter_ms": 290.0, "samples_per_s": 110.3}]},
         "FSDP2": {"error": "worker exit code 1", "candidates": []}}
    text = suite.format_c(c)
    assert "0.967" in text and "failed" in text
    tests = {"command": "python -m pytest tests/gpu", "returncode": 0, "seconds": 100.0, "passed": 50, "skipped": 0}
    report = suite.build_report(suite.report_header({"gpu": "NVIDIA H100", "torch": "2.13"}, "python benchmarks/gpu_suite.py", False),
                                [suite.format_tests(tests), text])
    assert report.startswith("# GPU suite results") and "NVIDIA H100" in report and "| 50" in report


def test_every_gpu_case_is_marked_and_has_one_skip_reason_without_cuda(monkeypatch):
    monkeypatch.setenv("FT_GPU_TESTS_DEVICE", "cuda")
    params = case_params()
    assert [p.id for p in params] == list(CASES)
    for p in params:
        assert any(m.name == "gpu" for m in p.marks)
        try:
            import torch

            cuda = torch.cuda.is_available()
        except ImportError:
            cuda = False
        if not cuda:
            skips = [m for m in p.marks if m.name == "skip"]
            assert len(skips) == 1 and "CUDA" in skips[0].kwargs["reason"]
            assert skip_reason(p.id) == skips[0].kwargs["reason"]


def test_run_configs_of_every_case_load(tmp_path):
    from ft_framework.config import load_config

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    for name, case in CASES.items():
        cfg = run_config(tmp_path / "model", tmp_path / name, case, "cpu", export_dir=tmp_path / "export",
                         resume_from=tmp_path / "ck")
        loaded = load_config(write_config(tmp_path / f"{name}.yaml", cfg), [])
        assert loaded.strategy.name == case.strategy["name"] and loaded.training.precision == case.precision


@pytest.mark.slow
def test_gpu_worker_runs_a_case_on_the_cpu(tmp_path, monkeypatch):
    """The worker end to end on the CPU (one single-process case), so a library change that breaks
    it shows here and not only on the GPU machine. Its main() runs in this process, as `python
    gpu_worker.py` runs it: the case is one process either way, and a second Python would import
    torch, transformers and the trainer again (4 s of CPU)."""
    pytest.importorskip("tokenizers")
    import torch

    from gpu_common import build_tiny_bert_dir

    model_dir = build_tiny_bert_dir(tmp_path / "model")
    # The worker's environment on the CPU (its import sets the last two where unset): restored after,
    # so that no later test, nor a GPU launch of tests/gpu, inherits the CPU accelerator.
    for name, value in (("FT_GPU_TESTS_DEVICE", "cpu"), ("DS_ACCELERATOR", "cpu"), ("CUBLAS_WORKSPACE_CONFIG", ":4096:8")):
        monkeypatch.setenv(name, value)
    import gpu_worker

    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        returncode = gpu_worker.main([str(tmp_path / "res"), str(model_dir), "single_fp32"])
    finally:  # main() turns deterministic algorithms on for the process
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
    rec = json.loads((tmp_path / "res" / "single_fp32.json").read_text())
    assert rec["error"] is None and returncode == 0, rec["error"]
    for phase in ("full", "resumed"):
        a = rec[phase]["anchors"]
        assert a["count"] == a["expected"] > 0 and not a["mismatched"] and not a["missing"]
        assert rec[phase]["impl"] == "cpu" and rec[phase]["steps"] == 5
    assert Path(rec["full_export"], "config.json").is_file()


def test_part_d_table_format():
    suite = load_benchmark("gpu_suite")
    d = {"model": "ALBERT-xxlarge", "numel": 222.6e6, "seq": 128, "batch": 32, "steps": 8, "warmup": 3,
         "candidates": [
             {"name": "RecAdam, overlapped offload (ours)", "iter_ms": 600.0, "samples_per_s": 53.3,
              "peak_gpu_gb": 4.2, "rollbacks": 1},
             {"name": "RecAdam, serial offload (ours)", "iter_ms": 800.0, "samples_per_s": 40.0,
              "peak_gpu_gb": 4.2, "rollbacks": 0},
             {"name": "DeepSpeedCPUAdam, ZeRO-2 offload", "error": "RuntimeError: no nvcc", "iter_ms": None}]}
    cap = dict(d, cap_gb=16, note="Memory fraction 0.200 of 80.0 GB.")
    text = suite.format_d(d, cap)
    assert text.count("| RecAdam, overlapped offload (ours) | 600.0") == 2 and "1.333" in text
    assert "no nvcc" in text and "capped at 16 GB" in text and "Memory fraction 0.200" in text
    assert "failed: boom" in suite.format_d({"error": "boom", "candidates": []}, None)


@pytest.fixture(scope="module")
def tiny_d_e_f(tmp_path_factory) -> tuple[dict, str, Path]:
    """`gpu_suite.py --tiny --only d,e,f` on the CPU: parts d, e and f at toy sizes in one run of the
    suite (each part's workers as in a run of it alone). Its raw JSON, its report and the report's
    path (the workers' rows files are beside it)."""
    report = tmp_path_factory.mktemp("tiny_d_e_f") / "suite.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_suite.py"), "--tiny", "--only", "d,e,f",
                          "--out", str(report)], capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return json.loads(report.with_suffix(".json").read_text()), report.read_text(), report


@pytest.mark.slow
def test_part_d_tiny_smoke_run(tiny_d_e_f):
    """Part d end to end at toy sizes on the CPU (deepspeed launcher, world size 1): the overlapped
    and serial offload and DeepSpeed ZeRO-2 offload each train and are tabled."""
    raw, report, _ = tiny_d_e_f
    cands = {c["name"]: c for c in raw["d"]["candidates"]}
    assert set(cands) == {"RecAdam, overlapped offload (ours)", "RecAdam, serial offload (ours)",
                          "DeepSpeedCPUAdam, ZeRO-2 offload"}, raw["d"]
    for c in cands.values():
        assert c.get("iter_ms") and c["iter_ms"] > 0 and not c.get("error"), c
    assert cands["RecAdam, overlapped offload (ours)"]["rollbacks"] is not None
    # No GPU memory to cap on the CPU: the capped run is left out, and so is its table.
    assert raw["d_cap"] is None and "## d. ALBERT-xxlarge" in report and "capped at" not in report


def test_part_e_table_format():
    suite = load_benchmark("gpu_suite")
    e = {"model": "ALBERT-xxlarge", "seq": 128, "batch": 32, "precision": "bf16", "cases": [
        {"name": "overlapped offload (single)", "planned_gb": 10.5, "measured_gb": 10.0, "planned_reserved_gb": 12.0,
         "measured_reserved_gb": 11.2},
        {"name": "DeepSpeed ZeRO-2 offload", "planned_gb": 8.0, "measured_gb": 10.0},
        {"name": "broken", "planned_gb": 1.0, "error": "RuntimeError: CUDA out of memory"}]}
    text = suite.format_e(e)
    assert "| overlapped offload (single) | 10.50" in text and "+5.0%" in text and "| yes" in text
    assert "-20.0%" in text and "| NO" in text and "CUDA out of memory" in text
    assert "failed: boom" in suite.format_e({"error": "boom", "cases": []})


@pytest.mark.slow
def test_part_e_tiny_smoke_run(tiny_d_e_f):
    """Part e end to end at toy sizes on the CPU: each case is planned before it is built, then
    trained, and the two numbers are tabled."""
    raw, report, _ = tiny_d_e_f
    cases = {c["name"]: c for c in raw["e"]["cases"]}
    assert set(cases) == {"overlapped offload (single)", "DeepSpeed ZeRO-2 offload"}, raw["e"]
    for c in cases.values():
        assert not c.get("error") and c["planned_gb"] > 0 and c["measured_gb"] > 0, c
    assert "## e. The memory plan against the measured peak" in report


def test_part_f_finds_the_allocations_live_at_the_peak():
    """A device trace replayed: the peak is the highest live total, and its bytes are grouped by the
    first Python line outside torch (a block freed before the peak is not counted)."""
    f = load_benchmark("gpu_part_f")
    torch_frame = {"filename": "/x/site-packages/torch/nn/functional.py", "line": 9, "name": "linear"}
    model = lambda line: [torch_frame, {"filename": "/m/modeling_albert.py", "line": line, "name": "forward"}]  # noqa: E731
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": model(10)},
        {"action": "alloc", "addr": 2, "size": 50, "frames": model(20)},
        {"action": "free_completed", "addr": 2, "size": 50, "frames": []},
        {"action": "alloc", "addr": 3, "size": 70, "frames": model(10)},
        {"action": "alloc", "addr": 4, "size": 30, "frames": [torch_frame]},
        {"action": "free_requested", "addr": 1, "size": 100, "frames": []},
        {"action": "alloc", "addr": 5, "size": 60, "frames": model(30)},
    ]
    top = f.top_lines_at_peak(events)
    assert top["peak_bytes"] == 200
    assert top["lines"] == [("/m/modeling_albert.py:10 (forward)", 170, 2),
                            ("/x/site-packages/torch/nn/functional.py:9 (linear)", 30, 1)]


def test_part_f_table_and_targets():
    suite, f = load_benchmark("gpu_suite"), load_benchmark("gpu_part_f")
    ours = {"name": "lean offload, overlapped (ours)", "batch": 32, "seq": 128, "steps": 3, "warmup": 1,
            "model": "ALBERT-xxlarge", "samples_per_s": 60.0, "measured_gb": 7.0, "measured_reserved_gb": 8.0,
            "planned_gb": 7.2, "planned_peak_gb": 8.1, "rollbacks": 2, "cap": {"cap_gb": 16, "largest_batch": 96},
            "speculated_steps": 4, "counted_steps": 4, "copy_waits": 3, "copy_wait_s": 0.012, "grad_norm": 12.5,
            "max_grad_norm": 1e9,
            "activations": "12 gelu_new module(s) -> fused tanh GELU"}
    ds = {"name": "DeepSpeed ZeRO-2 offload, DeepSpeedCPUAdam", "batch": 32, "samples_per_s": 50.0,
          "measured_gb": 14.0, "measured_reserved_gb": 15.0, "planned_gb": 11.0, "planned_peak_gb": 12.0,
          "cap": {"cap_gb": 16, "largest_batch": 40, "complete": False},
          "snapshot": {"file": "/o/f_snapshot_DeepSpeed_f2.pickle", "peak_bytes": 14e9,
                       "lines": [("/m/modeling_albert.py:10 (forward)", 9e9, 36)]}}
    serial = {"name": "lean offload, serial (ours)", "error": "worker exit code -1: timeout", "iter_ms": None}
    text = re.sub(r" +", " ", f.format_f({"rows": [ours, ds, serial]}, suite.markdown_table))  # cells are padded
    assert "| lean offload, overlapped (ours) | 60.0 " in text and "+2.9% (yes)" in text
    assert "-21.4% (NO)" in text and "40 (at least: time limit)" in text and "| 96 " in text
    assert "peak: ours / DeepSpeed = 0.50 (target <= 0.6: met)" in text
    assert "samples/s: ours / DeepSpeed = 1.20 (target >= 1: met)" in text
    assert "largest batch: ours / DeepSpeed = 2.40 (target >= 1.5: met)" in text
    assert "f_snapshot_DeepSpeed_f2.pickle" in text and "| /m/modeling_albert.py:10 (forward) | 9.000 | 36" in text
    assert "| lean offload, serial (ours) | failed" in text and "timeout" in text
    assert "| 12.500 | 4 / 2 of 4 | 3 (0.012 s) |" in text and "max_grad_norm 1e+09" in text


@pytest.mark.slow
def test_part_f_tiny_smoke_run(tiny_d_e_f):
    """Part f end to end at toy sizes on the CPU: each candidate in its worker, planned, trained,
    and its batch searched against a simulated limit of 6 (4 fits, 8 runs out of memory, 6 fits
    after it: our offload probing on, DeepSpeed's engine rebuilt; 7 runs out); ours fused,
    DeepSpeed's unchanged."""
    raw, report, report_path = tiny_d_e_f
    rows = {r["name"]: r for r in raw["f"]["rows"]}
    assert set(rows) == {"lean offload, overlapped (ours)", "lean offload, serial (ours)",
                         "DeepSpeed ZeRO-2 offload, DeepSpeedCPUAdam"}, raw["f"]
    for name, r in rows.items():
        assert not r.get("error") and not r.get("plan_error") and r["iter_ms"] > 0 and r["planned_gb"] > 0, r
        assert r["cap"]["largest_batch"] == 6 and r["cap"]["complete"] and not r["cap"].get("error"), r
        assert [tuple(p) for p in r["cap"]["probes"]] == [(4, True), (8, False), (6, True), (7, False)], r["cap"]
        assert ("fused tanh GELU" in r["activations"]) == ("ours" in name), r
    ours = rows["lean offload, overlapped (ours)"]
    # clipping that does not fire: every step of the overlapped offload speculated, none rolled back
    assert ours["grad_norm"] < ours["max_grad_norm"] and ours["rollbacks"] == 0, ours
    assert ours["speculated_steps"] == ours["counted_steps"] > 0, ours
    assert rows["DeepSpeed ZeRO-2 offload, DeepSpeedCPUAdam"]["speculated_steps"] is None
    assert "## f. The device-lean offload" in report
    part_f = load_benchmark("gpu_part_f")
    for name in rows:  # each worker's rows file ends with its finished row
        rows_file = report_path.with_name(f"{report_path.stem}_{part_f.worker_kind(name)}.rows.jsonl")
        last = [json.loads(line) for line in rows_file.read_text().splitlines()][-1]
        assert last["value"]["stage"] == "done" and last["value"]["iter_ms"] == rows[name]["iter_ms"]


@pytest.mark.slow
def test_part_f_stopped_by_its_time_limit_keeps_the_running_workers_measured_row(tmp_path):
    """SIGTERM to part f (what `timeout` sends at benchmarks/gpu_run_next.sh's limit) once its
    first worker has measured its batch, during its batch search: the worker's whole process group
    goes, and the report holds the row with its samples/s and peak as measured, marked stopped.
    The search runs up to --max-batch 4096 (a simulated limit of 1024: 20 probes, the largest
    batches the slowest), so the worker is still searching when the signal comes, however slowly
    this test sees its row."""
    import signal

    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    out = tmp_path / "part_f.md"
    rows_file = tmp_path / "part_f_f0.rows.jsonl"
    proc = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "gpu_suite.py"), "--tiny", "--only", "f",
                             "--max-batch", "4096", "--out", str(out)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env, cwd=REPO)
    try:
        deadline = time.time() + 400
        while time.time() < deadline and proc.poll() is None:
            if rows_file.is_file() and '"stage": "measured"' in rows_file.read_text():
                break
            time.sleep(0.2)
        assert proc.poll() is None, "part f ended before its first worker measured"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 124
    finally:
        if proc.poll() is None:
            proc.kill()
    raw = json.loads(out.with_suffix(".json").read_text())["f"]
    row = raw["rows"][0]
    assert row["name"] == "lean offload, overlapped (ours)" and row["iter_ms"] > 0 and row["samples_per_s"] > 0
    assert "stopped at the part's time limit" in row["error"]
    report = re.sub(r" +", " ", out.read_text())
    assert f"| lean offload, overlapped (ours) | {row['samples_per_s']:.1f} " in report


def test_the_next_gpu_run_script_parses_and_runs_f_then_a_with_limits():
    """benchmarks/gpu_run_next.sh: valid bash; part f first, then part a, each under `timeout`."""
    script = REPO / "benchmarks" / "gpu_run_next.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert "timeout -k" in text and text.index('part f "') < text.index("part a $")
    assert subprocess.run(["bash", "-n", str(REPO / "benchmarks" / "gpu_run.sh")], capture_output=True).returncode == 0


@pytest.mark.parametrize("selection", [["-k", "single_offload_lean"], ["-k", "zero2_offload and not compact"]],
                         ids=["lean", "zero2_offload"])
def test_k_selects_the_cases_the_launches_run(selection):
    """`pytest tests/gpu -k CASE` launches CASE alone (benchmarks/gpu_run_next.sh runs one case under
    a short limit): the launches are planned from the items left after -k deselected the rest, not
    from every collected case. The conftest reports its plan after collection. Installed plugins
    (hypothesis, xdist, ...) take no part in -k nor in the plan: not loaded (1.5 s of CPU a run)."""
    env = {**os.environ, "FT_GPU_TESTS_DEVICE": "cpu", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "--collect-only", "-q", "-p", "no:cacheprovider",
                          *selection], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    plan = next(line for line in out.stdout.splitlines() if line.startswith("gpu launches:"))
    expected = "python: single_offload_lean" if selection[1] == "single_offload_lean" else "deepspeed: zero2_offload"
    assert plan == f"gpu launches: {expected}", plan


@pytest.mark.slow
def test_part_a_checks_bits_first_and_a_kill_keeps_every_finished_row(tmp_path):
    """Part a's dry run, SIGKILLed at a random moment after its first rows: the rows come in the
    order that keeps the most of a short window (every bit-equality check before any timing,
    the torch.compile variants last), and every row the run said it had written is in its report
    and its JSON on disk."""
    import random
    import signal

    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    out = tmp_path / "part_a.md"
    proc = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "gpu_suite.py"), "--tiny", "--only", "a",
                             "--steps", "1", "--warmup", "1", "--out", str(out)], stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO)
    kill_after = random.Random().randint(1, 12)
    seen = 0
    try:
        for line in proc.stderr:
            m = re.search(r"\] a: (\d+) rows on disk", line)
            if m:
                seen = int(m.group(1))
                if seen >= kill_after:
                    break
        time.sleep(random.Random().uniform(0, 0.5))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert seen >= kill_after, f"the dry run ended before {kill_after} rows ({seen})"
    raw = json.loads(out.with_suffix(".json").read_text())["a"]
    rows = len(raw["bit_equality"]) + len(raw["candidates"])
    assert rows >= seen
    assert raw["bit_equality"] and all(x.get("equal") for x in raw["bit_equality"]), raw["bit_equality"]
    assert not raw["candidates"] or len(raw["bit_equality"]) == 16  # every check before the first timing
    # The bit checks come first (16): every one the run announced is in each file, each file whole
    # (written by renaming; the report may hold one row more or less than the JSON beside it).
    announced_checks = min(seen, 16)
    assert len(raw["bit_equality"]) >= announced_checks
    assert out.read_text().count("| yes") >= announced_checks



def test_the_wheels_check_says_in_one_line_what_to_carry(tmp_path):
    """benchmarks/gpu_run.sh check (the window's first step): no folder, or one lacking a wheel,
    is one line naming what to do and exit 2, before anything is installed."""
    script = REPO / "benchmarks" / "gpu_run.sh"
    for wheels in (tmp_path / "absent", tmp_path / "empty"):
        if wheels.name == "empty":
            wheels.mkdir()
        out = subprocess.run(["bash", str(script), "check"], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "FT_WHEELS": str(wheels), "PYTHON": sys.executable})
        lines = [line for line in out.stdout.splitlines() if line.strip()]
        assert out.returncode == 2 and len(lines) == 1, (out.returncode, out.stdout, out.stderr[-2000:])
        assert "gpu_run.sh prepare wheels" in lines[0] and 'carry=["wheels"]' in lines[0], lines[0]


@pytest.mark.slow
def test_part_g_tiny_smoke_run(tmp_path):
    """Part g (issue 43) end to end at toy sizes on the CPU: each candidate (ours, DeepSpeed ZeRO-2
    and ZeRO-3 offload) planned, set up, trained and its batch searched in a worker of its own, its
    rows written as measured (the last one finished), and the report tabled."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_part_g.py"), "--tiny", "--out",
                          str(tmp_path / "part_g.md")], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    rows = {}
    for rows_file in sorted(tmp_path.glob("part_g_g*.rows.jsonl")):
        last = [json.loads(line) for line in rows_file.read_text().splitlines()][-1]
        rows[last["name"]] = last
    assert len(rows) == 3 and any(name.startswith("ours") for name in rows), list(rows)
    for name, row in rows.items():
        assert row["stage"] == "done" and not row.get("error"), row
        assert row["tokens_per_s"] > 0 and row["planned_host_gb"] > 0 and row["train_peak_rss_gb"] > 0, row
        assert row["cap"]["largest_batch"] >= 1, row
    report = (tmp_path / "part_g.md").read_text()
    assert "## g. A 1B decoder" in report and report.count("DeepSpeedCPUAdam") >= 2
