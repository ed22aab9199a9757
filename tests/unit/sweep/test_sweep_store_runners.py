"""The results store and the local runner, with a fake training command (milliseconds a run):
statuses, logs, the index, re-runs, parallel slots, a killed sweep, the store lock, commands."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ft_framework.config import validate_config
from ft_framework.sweep import LocalRunner, SweepLockedError, SweepStore, run_sweep, validate_sweep
from ft_framework.sweep.runners import build_command
from ft_framework.sweep.spec import RunnerSpec
from sweep_helpers import BASE_RUN, fake_command, sweep_dict

HERE = Path(__file__).resolve().parent


def sweep(tmp_path, runner=None, **spec_extra):
    spec = validate_sweep(sweep_dict(**spec_extra))
    runner = runner or LocalRunner(spec.runner, command_fn=fake_command)
    return run_sweep(spec, output_dir=tmp_path / "store", runner=runner, progress=False)


def test_local_runner_runs_every_run_and_records_it(tmp_path):
    result = sweep(tmp_path)
    store = result.store
    assert result.complete and result.counts["finished"] == 6 and len(result.ran) == 6
    for run in result.runs:
        d = store.run_dir(run.run_id)
        assert {"config.yaml", "run.json", "status.json", "log.txt", "results.json", "metrics.jsonl"} <= {
            p.name for p in d.iterdir()}
        status = json.loads((d / "status.json").read_text())
        assert status["state"] == "finished" and status["attempts"] == 1 and status["returncode"] == 0
        assert "fake run" in (d / "log.txt").read_text()
        # The run's config is the resolved one, writing into its own directory.
        cfg = validate_config(__import__("yaml").safe_load((d / "config.yaml").read_text()))
        assert cfg.logging.output_dir == str(d) and cfg == run.config
    index = json.loads((store.root / "index.json").read_text())
    assert index["total"] == 6 and index["counts"]["finished"] == 6
    assert [e["id"] for e in index["runs"]] == [r.run_id for r in result.runs]
    assert index["runs"][0]["axes"] == {"training.seed": 1, "optimizer.hparams.anneal_k": 0.1}
    assert (store.root / "sweep.yaml").is_file()


def test_rerun_skips_finished_and_reruns_failed(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL_SEEDS", "2")
    first = sweep(tmp_path)
    assert first.counts["finished"] == 3 and first.counts["failed"] == 3 and not first.complete
    store = first.store
    failed = [r for r in first.runs if r.seed == 2]
    status = store.read_status(failed[0].run_id)
    assert status["state"] == "failed" and "exit code 1" in status["error"] and "something broke" in status["error"]
    mtimes = {r.run_id: store.run_dir(r.run_id).joinpath("results.json").stat().st_mtime_ns
              for r in first.runs if r.seed == 1}

    monkeypatch.delenv("FAKE_FAIL_SEEDS")
    second = sweep(tmp_path)
    assert second.complete and set(second.ran) == {r.run_id for r in failed}
    for r in second.runs:
        attempts = store.read_status(r.run_id)["attempts"]
        assert attempts == (2 if r.seed == 2 else 1)
        if r.seed == 1:
            assert store.run_dir(r.run_id).joinpath("results.json").stat().st_mtime_ns == mtimes[r.run_id]
    log = store.run_dir(failed[0].run_id).joinpath("log.txt").read_text()
    assert log.count("==== attempt") == 2 and "attempt 2" in log
    # Nothing is left to do: a third sweep runs nothing.
    assert sweep(tmp_path).ran == {}


def test_parallel_slots_get_their_threads(tmp_path):
    spec = validate_sweep(sweep_dict(runner={"max_parallel": 2, "num_cpus_per_run": 1}))
    runner = LocalRunner(spec.runner, command_fn=fake_command)
    assert [e["OMP_NUM_THREADS"] for e in runner._slots()] == ["1", "1"]
    result = run_sweep(spec, output_dir=tmp_path / "store", runner=runner, progress=False)
    assert result.complete
    assert all("threads 1" in result.store.run_dir(r.run_id).joinpath("log.txt").read_text() for r in result.runs)
    gpu_runner = LocalRunner(RunnerSpec(max_parallel=4, num_gpus_per_run=2, num_cpus_per_run=4),
                             gpu_ids=[0, 1, 2, 3, 4])
    assert [e["CUDA_VISIBLE_DEVICES"] for e in gpu_runner._slots()] == ["0,1", "2,3"]


def test_the_store_lock_keeps_a_second_sweep_out(tmp_path):
    store = SweepStore(tmp_path / "store")
    with store.lock():
        with pytest.raises(SweepLockedError, match="another ft-sweep"):
            with SweepStore(tmp_path / "store").lock():
                pass
    with store.lock():  # released
        pass


DRIVER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {here!r})
    from ft_framework.sweep import LocalRunner, run_sweep, validate_sweep
    from sweep_helpers import fake_command, sweep_dict
    spec = validate_sweep(sweep_dict(runner={{"max_parallel": 2}}))
    try:
        run_sweep(spec, output_dir={store!r}, runner=LocalRunner(spec.runner, command_fn=fake_command),
                  progress=False)
    except KeyboardInterrupt:
        sys.exit(143)  # as ft-sweep does on SIGTERM
""")


def _start_driver(tmp_path, env):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(here=str(HERE), store=str(tmp_path / "store")))
    return subprocess.Popen([sys.executable, str(script)], env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("timed out")


def _hanging(store):
    """Runs of seed 2 (they sleep) that are running; once both slots hold one, nothing changes."""
    out = []
    for d in store.runs_dir.glob("*"):
        status = store.read_status(d.name)
        info = store.read_run_info(d.name) or {}
        if status.get("state") == "running" and status.get("pid") and info.get("seed") == 2:
            out.append((d.name, status["pid"]))
    return out


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too; only our test could have reaped it otherwise.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_sweep_leaves_no_run_behind_and_the_next_one_finishes(tmp_path, sig):
    store = SweepStore(tmp_path / "store")
    # Seed 2's runs hang; seed 1's finish at once.
    driver = _start_driver(tmp_path, {"FAKE_SLEEP_SEEDS": "2"})
    _wait_for(lambda: len(_hanging(store)) == 2)
    running = _hanging(store)
    finished_before = {d.name for d in store.runs_dir.glob("*") if store.is_finished(d.name)}
    driver.send_signal(sig)
    out = driver.communicate(timeout=60)[0]
    assert driver.returncode == (143 if sig == signal.SIGTERM else -sig), out
    # The runs in flight die with the sweep (SIGTERM: stopped by it; SIGKILL: PR_SET_PDEATHSIG).
    _wait_for(lambda: not any(_alive(pid) for _, pid in running), timeout=20)
    for run_id, _ in running:
        state = store.read_status(run_id)["state"]
        assert state == ("interrupted" if sig == signal.SIGTERM else "running")  # a SIGKILL records nothing

    # Re-run without hanging runs: finished ones stay, the others run.
    spec = validate_sweep(sweep_dict())
    result = run_sweep(spec, output_dir=store.root, runner=LocalRunner(spec.runner, command_fn=fake_command),
                       progress=False)
    assert result.complete and not (set(result.ran) & finished_before)
    for run_id, _ in running:
        assert store.read_status(run_id)["attempts"] == 2
    index = json.loads((store.root / "index.json").read_text())
    assert index["counts"]["finished"] == 6 == len(index["runs"])


def test_stale_running_status_is_settled(tmp_path):
    result = sweep(tmp_path)
    store = result.store
    a, b = result.runs[0].run_id, result.runs[1].run_id
    # A dead sweep left both "running": a with results.json written (recovered), b without.
    store.write_status(a, state="running", pid=None)
    store.write_status(b, state="running", pid=None)
    store.run_dir(b).joinpath("results.json").unlink()
    # c's process outlived its sweep (no PR_SET_PDEATHSIG): it is stopped before c runs again; an
    # unrelated process that happens to have a recorded pid is left alone.
    c, d = result.runs[2].run_id, result.runs[3].run_id
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                               str(store.run_dir(c) / "config.yaml")], start_new_session=True)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    host = __import__("socket").gethostname()
    store.write_status(c, state="running", pid=orphan.pid, host=host)
    store.write_status(d, state="running", pid=bystander.pid, host=host)
    store.run_dir(c).joinpath("results.json").unlink()
    try:
        with store.lock():
            store.sync(result.runs)
        assert orphan.wait(timeout=10) == -signal.SIGKILL
        assert bystander.poll() is None
    finally:
        bystander.kill()
        orphan.kill()
        bystander.wait()
    assert store.read_status(a)["state"] == "finished" and "recovered" in store.read_status(a)["note"]
    assert store.read_status(b)["state"] == "interrupted"
    assert store.read_status(c)["state"] == "interrupted"


def test_interrupted_run_with_a_checkpoint_resumes(tmp_path):
    result = sweep(tmp_path)
    store = result.store
    run = result.runs[0]
    d = store.run_dir(run.run_id)
    store.write_status(run.run_id, state="interrupted")
    (d / "checkpoints").mkdir()
    (d / "checkpoints" / "latest").write_text("step_00000001")
    again = sweep(tmp_path)
    assert set(again.ran) == {run.run_id}
    status = store.read_status(run.run_id)
    assert status["resumed"] is True and status["command"][-1] == "resume"
    # Without a checkpoint the logs of the previous attempt are dropped, not appended to.
    run2 = result.runs[1]
    store.write_status(run2.run_id, state="failed")
    sweep(tmp_path)
    lines = store.run_dir(run2.run_id).joinpath("metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3


def test_build_command_follows_the_strategy(tmp_path):
    cfg = validate_config(dict(BASE_RUN))
    single = build_command(tmp_path / "c.yaml", cfg, RunnerSpec(), resume=False)
    assert single == [sys.executable, "-m", "ft_framework.cli", "--config", str(tmp_path / "c.yaml")]
    ddp = cfg.model_copy(update={"strategy": cfg.strategy.model_copy(update={"name": "ddp"})})
    cmd = build_command(tmp_path / "c.yaml", ddp, RunnerSpec(num_gpus_per_run=4), resume=True)
    assert cmd[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"]
    assert cmd[-1] == "checkpoint.resume_from=latest"
    ds = build_command(tmp_path / "c.yaml", ddp, RunnerSpec(num_gpus_per_run=2, launcher="deepspeed"), resume=False)
    assert ds[:2] == ["deepspeed", "--num_gpus=2"] and "--module" in ds
    with pytest.raises(ValueError, match="distributed launcher"):
        build_command(tmp_path / "c.yaml", ddp, RunnerSpec(launcher="python"), resume=False)
