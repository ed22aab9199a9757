"""A sweep store handed to ft-report (or ft-sweep) is data: a run's status.json linked to /dev/zero or
to a file outside, a named pipe as status.json, a status.json that is no JSON object, a results.json
that is no run's results and a sweep.yaml nested thousands deep are each refused in one line, exit 2,
without reading anything outside and without a hang (an alarm turns one into a failure)."""

from __future__ import annotations

import json
import os

import pytest

from bounded import memory_bounded, no_block
from ft_framework.cli import report_main, sweep_main
from ft_framework.run.files import INDEX_FILE, RESULTS_FILE, STATUS_FILE, SWEEP_FILE
from ft_framework.sweep.store import SweepStore
from sweep_helpers import write_results

@pytest.fixture
def store(tmp_path):
    """A store of two finished runs (an index, run.json, status.json, results.json each), and a file
    outside it."""
    root = tmp_path / "store"
    entries = []
    for seed in (1, 2):
        run_id = f"run{seed}".ljust(12, "x")
        run_dir = root / "runs" / run_id
        axes = {"data.task": "rte", "training.seed": seed}
        entry = {"id": run_id, "method": "recadam", "task": "rte", "seed": seed, "axes": axes}
        run_dir.mkdir(parents=True)
        (run_dir / "run.json").write_text(json.dumps(entry))
        (run_dir / STATUS_FILE).write_text(json.dumps({"state": "finished", "attempts": 1}))
        write_results(run_dir, task="rte", score=0.6 + 0.01 * seed, failed=False)
        entries.append({**entry, "state": "finished", "dir": f"runs/{run_id}"})
    (root / INDEX_FILE).write_text(json.dumps({"runs": entries}))
    (root / SWEEP_FILE).write_text("report: {seed_keys: [training.seed]}\n")
    outside = tmp_path / "os-release"
    outside.write_text('NAME="not a results file"\n')
    return root, root / "runs" / entries[0]["id"], outside


def report_refuses(root, capsys, *says: str) -> str:
    with no_block("a named pipe in the store was opened"):
        assert report_main([str(root), "--no-plots", "--out", str(root.parent / "report")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ft-report: error: ") and "Traceback" not in err, err
    for part in says:
        assert part in err, err
    assert not (root.parent / "report").exists()
    return err


def test_the_untouched_store_reports(store, capsys):
    root, _, _ = store
    assert report_main([str(root), "--no-plots", "--out", str(root.parent / "report")]) == 0


def test_status_linked_to_dev_zero_is_refused_unread(store, capsys):
    root, run_dir, _ = store
    (run_dir / STATUS_FILE).unlink()
    (run_dir / STATUS_FILE).symlink_to("/dev/zero")
    with memory_bounded():
        report_refuses(root, capsys, "'status.json'", "leads outside it through a symlink")


def test_status_as_a_named_pipe_is_refused_without_a_hang(store, capsys):
    root, run_dir, _ = store
    (run_dir / STATUS_FILE).unlink()
    os.mkfifo(run_dir / STATUS_FILE)
    report_refuses(root, capsys, f"{run_dir / STATUS_FILE} is a named pipe, not a regular file")


def test_results_linked_to_a_file_outside_is_refused_unopened(store, capsys):
    root, run_dir, outside = store
    (run_dir / RESULTS_FILE).unlink()
    (run_dir / RESULTS_FILE).symlink_to(outside)
    err = report_refuses(root, capsys, "'results.json'", "leads outside it through a symlink")
    assert "not a results file" not in err


def test_status_that_is_no_json_object_is_refused(store, capsys):
    root, run_dir, _ = store
    (run_dir / STATUS_FILE).write_text("[1]")
    report_refuses(root, capsys, f"{run_dir / STATUS_FILE}: holds a JSON array, expected an object")
    # ft-sweep reads the same file of its store: the same line.
    (run_dir / STATUS_FILE).write_text("[1]")
    assert SweepStore(root).read_index() is not None
    with pytest.raises(ValueError, match="holds a JSON array, expected an object"):
        SweepStore(root).read_status(run_dir.name)


def test_results_that_are_no_runs_results_are_refused(store, capsys):
    root, run_dir, _ = store
    (run_dir / RESULTS_FILE).write_text(json.dumps({"task": "rte"}))
    report_refuses(root, capsys, f"{run_dir / RESULTS_FILE}: not the results.json of a run of ft-train")


def test_an_index_that_is_no_list_of_runs_is_refused(store, capsys):
    root, _, _ = store
    (root / INDEX_FILE).write_text(json.dumps({"runs": [1, 2]}))
    report_refuses(root, capsys, f"{root / INDEX_FILE}: its runs entry is not a list of runs")


def test_a_deeply_nested_sweep_file_is_refused(store, capsys):
    root, _, _ = store
    (root / SWEEP_FILE).write_text("report: " + "[" * 3000 + "]" * 3000 + "\n")
    report_refuses(root, capsys, f"{root / SWEEP_FILE}", "nested deeper than")


def test_ft_sweep_refuses_a_sweep_file_nested_thousands_deep(tmp_path, capsys):
    (tmp_path / "sweep.yaml").write_text("base: " + "[" * 3000 + "]" * 3000 + "\n")
    assert sweep_main(["--config", str(tmp_path / "sweep.yaml"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ft-sweep: error: ") and "nested deeper than" in err, err
