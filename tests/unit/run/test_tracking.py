"""Trackers (ft_framework/run/tracking.py) with the real libraries: MLflow's local store in a temp dir,
read back through MlflowClient; W&B in offline mode, read back from its run directory (the
transaction log run-<id>.wandb). A run's records go through MetricsLogger as the trainer sends them;
a resumed run continues the same tracker runs. The real trainer: tests/recipes/test_tracking_run.py."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ft_framework.config import ConfigError, validate_config
from ft_framework.run.logs import MetricsLogger
from ft_framework.config import flatten_dotted as flatten_config
from ft_framework.run.tracking import _retry, default_mlflow_uri, missing_tracker_packages, open_trackers

BASE = {"model": {"name_or_path": "x"}, "data": {"task": "sst2"}, "schedule": {"warmup_steps": 0},
        "training": {"max_steps": 1}}

RECORDS = [
    {"type": "train", "step": 1, "epoch": 0, "loss": 0.7, "lr": 1e-3, "grad_norm": 1.5, "lambda": [0.1, None],
     "forgetting_distance": 0.01},
    {"type": "train", "step": 2, "epoch": 0, "loss": 0.6, "lr": 1e-3, "grad_norm": float("nan"), "lambda": [0.2, None],
     "forgetting_distance": 0.02},
    {"type": "eval", "step": 2, "metrics": {"validation": {"accuracy": 0.5}}},
    {"type": "train", "step": 3, "epoch": 1, "loss": 0.5, "lr": 5e-4, "grad_norm": 1.0, "lambda": [0.3, None],
     "forgetting_distance": 0.03},
    {"type": "eval", "step": 3, "metrics": {"validation": {"accuracy": 0.75}}},
]


def config(tmp_path, **logging):
    data = json.loads(json.dumps(BASE))
    data["logging"] = {"output_dir": str(tmp_path / "run"), "run_name": "my-run", "experiment": "my-sweep", **logging}
    return validate_config(data)


def send(cfg, records, resuming=False, finish=True):
    log = MetricsLogger(Path(cfg.logging.output_dir), trackers=open_trackers(cfg, resuming=resuming))
    for r in records:
        log.write(r)
    results = Path(cfg.logging.output_dir) / "results.json"
    if finish:
        results.write_text(json.dumps({"ok": True}))
        log.log_artifact(results)
    log.close(ok=finish)


# ---- config ------------------------------------------------------------------------------------


def test_report_to_defaults_follow_the_old_tensorboard_flag():
    assert validate_config(BASE).logging.report_to == []
    old = validate_config({**BASE, "logging": {"tensorboard": True}}).logging
    assert old.report_to == ["tensorboard"] and old.tensorboard
    new = validate_config({**BASE, "logging": {"report_to": ["tensorboard", "mlflow"]}}).logging
    assert new.tensorboard
    with pytest.raises(ConfigError, match="does not list tensorboard"):
        validate_config({**BASE, "logging": {"tensorboard": True, "report_to": ["mlflow"]}})
    with pytest.raises(ConfigError, match="report_to"):
        validate_config({**BASE, "logging": {"report_to": ["comet"]}})
    # The resolved config validates back to itself (results.json -> re-validation).
    cfg = validate_config({**BASE, "logging": {"tensorboard": True}})
    assert validate_config(cfg.to_dict()).to_dict() == cfg.to_dict()


def test_missing_tracker_is_a_config_error_naming_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert missing_tracker_packages(["mlflow"]) == []
    with pytest.raises(ConfigError, match=r"pip install 'ft_framework\[wandb\]'"):
        validate_config({**BASE, "logging": {"report_to": ["wandb"]}})


def test_flatten_config():
    assert flatten_config({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}, "f": None}) == \
        {"a.b": 1, "a.c.d": [1, 2], "e": {}, "f": None}


# ---- MLflow --------------------------------------------------------------------------------------


def test_mlflow_gets_params_metrics_artifacts_and_a_resume_continues_the_run(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()   # MLflow's file store
    cfg = config(tmp_path, report_to=["mlflow"], mlflow={"tracking_uri": uri})
    send(cfg, RECORDS[:3], finish=False)                  # an attempt interrupted after step 2
    first = json.loads((tmp_path / "run" / "trackers.json").read_text())["mlflow"]
    send(cfg, RECORDS[3:], resuming=True)                 # resumed from its checkpoint
    assert json.loads((tmp_path / "run" / "trackers.json").read_text())["mlflow"]["run_id"] == first["run_id"]

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("my-sweep")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_name == "my-run" and run.info.status == "FINISHED"
    params = run.data.params
    assert params["optimizer.name"] == "recadam" and params["training.max_steps"] == "1"
    assert params["logging.report_to"] == '["mlflow"]'
    assert set(params) == set(flatten_config(cfg.to_dict()))

    def history(key):
        return [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]

    assert history("train/loss") == [(1, 0.7), (2, 0.6), (3, 0.5)]
    assert history("train/grad_norm") == [(1, 1.5), (3, 1.0)]            # nan left out, as for TensorBoard
    assert history("train/lambda/group_0") == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert history("eval/validation/accuracy") == [(2, 0.5), (3, 0.75)]
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["results.json"]


# ---- W&B -----------------------------------------------------------------------------------------


def read_wandb_log(path: Path) -> list:
    """The records of a W&B transaction log (run-<id>.wandb): a 7-byte header, then LevelDB-style
    32 KiB blocks of chunks (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, raw = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            raw.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            raw.append(pending + chunk)
    records = []
    for r in raw:
        rec = pb.Record()
        rec.ParseFromString(r)
        records.append(rec)
    return records


def complete_log(path: Path, timeout: float = 30.0) -> list:
    """The log's records once its exit record is there (W&B's service may still be writing it
    for a moment after run.finish() returned)."""
    deadline = time.monotonic() + timeout
    while True:
        records = read_wandb_log(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def wandb_runs(directory: Path) -> list[dict]:
    out = []
    for log in sorted(directory.glob("wandb/offline-run-*/run-*.wandb")):
        run = {"history": [], "files": [], "config": {}}
        for rec in complete_log(log):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run.update(id=rec.run.run_id, group=rec.run.run_group, name=rec.run.display_name)
                run["config"].update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
            elif kind == "history":
                run["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                       for i in rec.history.item})
            elif kind == "files":
                run["files"] += [f.path for f in rec.files.files]
        out.append(run)
    return out


def test_wandb_offline_gets_the_same_records_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = config(tmp_path, report_to=["wandb"])
    send(cfg, RECORDS[:3], finish=False)
    send(cfg, RECORDS[3:], resuming=True)
    saved = json.loads((tmp_path / "run" / "trackers.json").read_text())["wandb"]
    assert saved["mode"] == "offline"
    runs = wandb_runs(tmp_path / "run")
    assert len(runs) == 2 and {r["id"] for r in runs} == {saved["id"]}   # one run, two attempts
    first, resumed = runs
    assert first["group"] == "my-sweep" and first["name"] == "my-run"
    assert first["config"]["optimizer.name"] == "recadam"
    assert set(first["config"]) >= set(flatten_config(cfg.to_dict()))
    rows = [row for run in runs for row in run["history"]]
    steps = {row["_step"]: row for row in rows}
    assert sorted(steps) == [1, 2, 3]
    assert [steps[s]["train/loss"] for s in (1, 2, 3)] == [0.7, 0.6, 0.5]
    assert "train/grad_norm" not in steps[2]
    assert steps[2]["eval/validation/accuracy"] == 0.5 and steps[3]["eval/validation/accuracy"] == 0.75
    assert "results.json" in resumed["files"]


def test_only_the_main_process_opens_trackers(tmp_path):
    cfg = config(tmp_path, report_to=["mlflow", "wandb"])
    assert open_trackers(cfg, enabled=False) == []
    assert not (tmp_path / "run" / "trackers.json").exists()


def _open_mlflow_runs_after(barrier, jobs, results):
    """One run of a sweep that starts with the others, for each store it is given: in the environment
    the test gives it, it waits for the others at the barrier, then opens an MLflow run there; it
    reports None or its traceback."""
    import traceback

    import mlflow.tracking  # noqa: F401 - imported before the barrier, so that it does not stagger the runs

    from ft_framework.run.tracking import MLflowTracker

    for uri, env in iter(jobs.get, None):
        os.environ.clear()
        os.environ.update(env)
        barrier.wait()  # all processes ask for the experiment at the same moment
        try:
            MLflowTracker(tracking_uri=uri, experiment="shared", run_name="r", params={})
            results.put(None)
        except BaseException:  # noqa: BLE001 - reported to the test
            results.put(traceback.format_exc())


@pytest.fixture(scope="module")
def parallel_mlflow_runs():
    """open(uri): four spawned processes open an MLflow run in store `uri` at the same moment, each in
    the calling test's environment; their tracebacks (None: opened). The processes are started once
    for the tests of this file: each imports MLflow, seconds of CPU."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    jobs = [ctx.Queue() for _ in range(4)]
    procs = [ctx.Process(target=_open_mlflow_runs_after, args=(barrier, q, results)) for q in jobs]
    for p in procs:
        p.start()

    def open_runs(uri: str) -> list:
        for q in jobs:
            q.put((uri, dict(os.environ)))
        return [results.get(timeout=120) for _ in procs]

    yield open_runs
    for q in jobs:
        q.put(None)
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join()


@pytest.mark.slow
@pytest.mark.parametrize("store", ["sqlite_default", "file"])
def test_parallel_runs_share_one_mlflow_experiment(tmp_path, monkeypatch, store, parallel_mlflow_runs):
    """A sweep's runs start together and name the same experiment in a new store: opening the store
    (MLflow's Default experiment; a new SQLite database's tables) and get-or-create of the experiment
    each check, then create, so without the lock runs failed on the Default experiment or the tables,
    or each made an experiment of its own (about 1 sweep in 4 on the file store)."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    if store == "file":
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        uri = (tmp_path / "mlruns").as_uri()
    else:  # what a run gets by default: a SQLite database in the output root, shared by side-by-side runs
        uri = default_mlflow_uri(tmp_path / "runs" / "one_run")
    errors = parallel_mlflow_runs(uri)
    assert errors == [None] * 4, "\n".join(e for e in errors if e)
    client = MlflowClient(uri)
    shared = [e for e in client.search_experiments() if e.name == "shared"]
    assert len(shared) == 1
    assert len(client.search_runs([shared[0].experiment_id])) == 4


def test_default_mlflow_store_is_sqlite_in_the_output_root(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert default_mlflow_uri(tmp_path / "runs" / "quickstart") == f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert default_mlflow_uri(tmp_path / "runs" / "quickstart") == "http://127.0.0.1:5000"


def test_a_run_reports_to_the_default_sqlite_store_and_mlflow_reads_it_without_extra_variables(tmp_path, monkeypatch):
    """With no tracking_uri and no MLFLOW_* variable, a run's tracker writes <output root>/mlflow.db,
    and a fresh process (as `mlflow ui --backend-store-uri sqlite:///...` would) reads it back."""
    pytest.importorskip("mlflow")
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(name, raising=False)
    cfg = config(tmp_path, report_to=["mlflow"])
    (tracker,) = open_trackers(cfg)
    tracker.log_metrics({"train/loss": 0.5}, step=1)
    tracker.finish()
    db = tmp_path / "mlflow.db"
    assert db.is_file() and tracker.tracking_uri == f"sqlite:///{db}"
    reader = (f"from mlflow.tracking import MlflowClient; c = MlflowClient('sqlite:///{db}'); "
              f"print(c.get_run('{tracker.run_id}').data.metrics['train/loss'])")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    out = subprocess.run([sys.executable, "-c", reader], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "0.5"


# ---- what _retry tries again: types, never the text of a message ------------------------------------
def _locked_database_error(tmp_path):
    """A real `database is locked`: a second connection writes while the first holds the database."""
    import sqlite3

    db = tmp_path / "locked.db"
    holder = sqlite3.connect(db, timeout=0)
    holder.execute("CREATE TABLE t (x)")
    holder.commit()
    holder.execute("BEGIN EXCLUSIVE")
    writer = sqlite3.connect(db, timeout=0)
    try:
        writer.execute("INSERT INTO t VALUES (1)")
    except sqlite3.OperationalError as exc:
        return exc, holder
    raise AssertionError("the database was not locked")


def test_retry_tries_a_locked_database_again(tmp_path):
    error, holder = _locked_database_error(tmp_path)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("the store said no") from error  # wrapped, as MLflow and SQLAlchemy do
        return "ok"

    assert _retry(flaky, "experiment") == "ok" and len(calls) == 3
    holder.rollback()


def test_retry_tries_an_experiment_created_meanwhile_again():
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS

    calls = []

    def race():
        calls.append(1)
        if len(calls) == 1:
            raise MlflowException("Experiment 'shared' already exists.", error_code=RESOURCE_ALREADY_EXISTS)
        return "id"

    assert _retry(race, "experiment") == "id" and len(calls) == 2


@pytest.mark.parametrize("message", ["database is locked", "lock file missing", "already exists"])
def test_retry_does_not_read_the_message(message):
    """An error that only says "lock" or "exist" is not tried again: it is raised at once."""
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError(message)

    with pytest.raises(RuntimeError, match=message):
        _retry(broken, "experiment")
    assert len(calls) == 1
