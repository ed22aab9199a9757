"""Experiment trackers: MLflow and Weights & Biases, beside metrics.jsonl and TensorBoard.

``logging.report_to`` lists where a run reports: ``tensorboard``, ``mlflow``, ``wandb``. What each
tracker gets:

- params: the flattened resolved config (``optimizer.hparams.lr`` = ...), once per tracker run;
- metrics: the records of metrics.jsonl, with the same steps and TensorBoard's names
  (``train/loss``, ``train/lambda/group_0``, ``eval/validation/accuracy``); non-finite values are
  left out, as for TensorBoard;
- artifacts: results.json at the end of the run, and the PNGs that ft-interpolate and ft-report
  write for the run (they re-open the run's tracker runs, see :func:`log_artifacts_to_run`).

Only rank 0 opens trackers. The ids of the tracker runs are kept in ``<output_dir>/trackers.json``:
a resumed run (``checkpoint.resume_from``) continues the same MLflow run / W&B run instead of
starting a second one. Records past the checkpoint that an interrupted attempt had sent already are
sent again by the resumed one (metrics.jsonl drops them; MLflow keeps both values of such a step in
its history, W&B ignores steps it has seen).

MLflow: ``logging.mlflow.tracking_uri``, else ``MLFLOW_TRACKING_URI``, else a SQLite database in the
output root, ``sqlite:///<parent of logging.output_dir>/mlflow.db`` (``runs/mlflow.db`` for
``runs/quickstart``; a sweep's runs, which sit side by side, share it), with artifacts in
``mlflow-artifacts/`` beside it. ``mlflow ui --backend-store-uri sqlite:///runs/mlflow.db`` opens it
as it is (MLflow 3 refuses its plain file store unless MLFLOW_ALLOW_FILE_STORE=true, which is set for
the process only when a ``file:`` URI is asked for by name). The experiment is
``logging.experiment`` (a sweep sets it to the sweep's name, so its runs share one experiment),
else ``ft_framework``; the run name is ``logging.run_name``, else the output directory's name.

W&B: project ``logging.wandb.project``, group ``logging.experiment`` (a sweep's runs form one
group), offline mode when no ``WANDB_API_KEY`` is set (``logging.wandb.mode`` overrides); the run
directory is ``<output_dir>/wandb`` unless ``logging.wandb.dir`` says otherwise.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import math
import os
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence
from urllib.parse import urlparse
from urllib.request import url2pathname

from ft_framework.dotted import flatten_dotted
from ft_framework.run.files import MLFLOW_ARTIFACTS_DIR, MLFLOW_DB_FILE, TRACKERS_FILE

logger = logging.getLogger(__name__)

__all__ = ["TRACKERS", "TRACKER_EXTRAS", "Tracker", "MLflowTracker", "WandbTracker",
           "missing_tracker_packages", "open_trackers", "log_artifacts_to_run",
           "default_mlflow_uri"]

TRACKERS = ("tensorboard", "mlflow", "wandb")
# tracker -> (module to import, pip extra of ft_framework)
TRACKER_EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow"),
                  "wandb": ("wandb", "wandb")}
DEFAULT_EXPERIMENT = "ft_framework"
_MLFLOW_PARAM_VALUE_MAX = 6000
_MLFLOW_BATCH = 100


def missing_tracker_packages(report_to: Iterable[str]) -> list[str]:
    """One message per tracker of `report_to` whose package is not installed (naming the pip extra)."""
    out = []
    for name in report_to:
        module, extra = TRACKER_EXTRAS[name]
        if importlib.util.find_spec(module) is None:
            out.append(f"logging.report_to lists {name!r}, but {module} is not installed: "
                       f"pip install 'ft_framework[{extra}]' (or: pip install {module})")
    return out


class Tracker(Protocol):
    name: str

    def state(self) -> dict[str, Any]: ...
    def log_metrics(self, values: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: Path) -> None: ...
    def finish(self, ok: bool = True) -> None: ...


# --------------------------------------------------------------------------------------------------
# MLflow
# --------------------------------------------------------------------------------------------------


def default_mlflow_uri(output_dir: str | Path) -> str:
    """MLFLOW_TRACKING_URI, else the SQLite database in the output root (the directory that holds
    the run's output directory): sqlite:///<absolute path>/mlflow.db."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{Path(output_dir).absolute().parent / MLFLOW_DB_FILE}"


def _sqlite_path(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None


def _prepare_mlflow_uri(uri: str) -> tuple[str, str | None]:
    """(tracking URI, artifact location for new experiments or None for MLflow's default)."""
    if uri.startswith("file:") or "://" not in uri and not uri.startswith("sqlite:"):
        # The plain file store was asked for by name: MLflow 3 only needs to be told it is wanted.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        return uri, None
    db = _sqlite_path(uri)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
        return uri, (db.parent / MLFLOW_ARTIFACTS_DIR).absolute().as_uri()
    return uri, None


def _transient(exc: BaseException | None) -> bool:
    """A locked SQLite database (SQLITE_BUSY or SQLITE_LOCKED anywhere in the exception's chain:
    MLflow wraps SQLAlchemy's error, which wraps sqlite3's) or an experiment another run created in
    the meantime (MLflow's RESOURCE_ALREADY_EXISTS): both pass when tried again."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, sqlite3.Error) and exc.sqlite_errorcode in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
            return True
        if getattr(exc, "error_code", None) == "RESOURCE_ALREADY_EXISTS":  # mlflow.exceptions.MlflowException
            return True
        exc = getattr(exc, "orig", None) or exc.__cause__ or exc.__context__  # orig: SQLAlchemy's DBAPIError
    return False


def _retry(fn, what: str, attempts: int = 5):
    """SQLite stores shared by a sweep's parallel runs can be briefly locked: try again."""
    for i in range(attempts):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - MLflow raises several types; _transient tells them apart
            if i == attempts - 1 or not _transient(exc):
                raise
            logger.debug("mlflow %s failed (%s); retrying", what, exc)
            time.sleep(0.2 * (i + 1))


def _local_lock_file(uri: str) -> Path | None:
    """The lock file of a store on this machine's file system (a file store's directory, a SQLite
    database), None for a server."""
    db = _sqlite_path(uri)
    if db is not None:
        return db.with_name(db.name + ".lock")
    if "://" in uri and not uri.startswith("file:"):
        return None
    root = Path(url2pathname(urlparse(uri).path) if uri.startswith("file:") else uri)
    return root / ".ft_experiment.lock"


@contextlib.contextmanager
def _experiment_lock(uri: str):
    """Serializes the steps of a local store that check, then create: opening a new store (MLflow
    creates its Default experiment; a new SQLite database runs its schema migrations) and
    get-or-create of an experiment. A sweep's runs start together: without the lock two of them
    failed creating the same Default experiment or the same tables, or each created "its"
    experiment of the same name and landed in a different one. A server refuses a duplicate name
    itself (the creating run retries and finds the other's)."""
    lock = _local_lock_file(uri)
    if lock is None:
        yield
        return
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class MLflowTracker:
    name = "mlflow"

    def __init__(self, *, tracking_uri: str, experiment: str, run_name: str, params: dict[str, Any],
                 resume: dict[str, Any] | None = None, tags: dict[str, str] | None = None):
        from mlflow.tracking import MlflowClient

        uri, artifact_location = _prepare_mlflow_uri(tracking_uri)
        if resume and resume.get("tracking_uri"):
            uri = resume["tracking_uri"]
        self.tracking_uri = uri
        with _experiment_lock(uri):
            self.client = MlflowClient(uri)
            self.client.search_experiments(max_results=1)  # opens (and, if new, creates) the store under the lock
        if resume and resume.get("run_id"):
            self.run_id = resume["run_id"]
            self.experiment_id = resume.get("experiment_id")
            self.client.update_run(self.run_id, status="RUNNING")
            return
        self.experiment_id = _retry(lambda: self._experiment_id(experiment, artifact_location), "experiment")
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags or {})
        self.run_id = run.info.run_id
        self._log_params(params)

    def _experiment_id(self, name: str, artifact_location: str | None) -> str:
        with _experiment_lock(self.tracking_uri):
            found = self.client.get_experiment_by_name(name)
            if found is not None:
                return found.experiment_id
            return self.client.create_experiment(name, artifact_location=artifact_location)

    def _log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k[:250], json.dumps(v) if isinstance(v, (list, dict)) else str(v))
                 for k, v in params.items()]
        items = [Param(p.key, p.value[:_MLFLOW_PARAM_VALUE_MAX]) for p in items]
        for i in range(0, len(items), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + _MLFLOW_BATCH])

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "experiment_id": self.experiment_id, "tracking_uri": self.tracking_uri}

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, int(step)) for k, v in values.items()]
        for i in range(0, len(metrics), _MLFLOW_BATCH * 10):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + _MLFLOW_BATCH * 10])

    def log_artifact(self, path: Path, subdir: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path=subdir)

    def finish(self, ok: bool = True) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


# --------------------------------------------------------------------------------------------------
# Weights & Biases
# --------------------------------------------------------------------------------------------------


class WandbTracker:
    name = "wandb"

    def __init__(self, *, project: str, entity: str | None, group: str | None, run_name: str, mode: str | None,
                 directory: Path, params: dict[str, Any], resume: dict[str, Any] | None = None):
        import wandb

        mode = mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        directory.mkdir(parents=True, exist_ok=True)
        run_id = (resume or {}).get("id")
        if not run_id:
            from wandb.sdk.lib.runid import generate_id

            run_id = generate_id()
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True)
        self.run = wandb.init(project=project, entity=entity, group=group, name=run_name, id=run_id,
                              resume="allow" if resume else None, dir=str(directory), mode=mode,
                              config=None if resume else params, settings=settings, reinit="create_new")
        self.mode = mode
        self.directory = directory

    def state(self) -> dict[str, Any]:
        return {"id": self.run.id, "project": self.run.project, "mode": self.mode, "dir": str(self.directory),
                "run_dir": self.run.dir}

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        self.run.log(dict(values), step=int(step))

    def log_artifact(self, path: Path, subdir: str | None = None) -> None:
        self.run.save(str(path), base_path=str(Path(path).parent), policy="now")

    def finish(self, ok: bool = True) -> None:
        self.run.finish(exit_code=0 if ok else 1)


# --------------------------------------------------------------------------------------------------
# Opening the trackers of a run
# --------------------------------------------------------------------------------------------------


def _read_state(output_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(output_dir) / TRACKERS_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _write_state(output_dir: Path, trackers: Sequence[Tracker]) -> None:
    path = Path(output_dir) / TRACKERS_FILE
    state = {**_read_state(output_dir), **{t.name: t.state() for t in trackers}}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(path)


def _open(name: str, logging_cfg: Any, output_dir: Path, params: dict[str, Any],
          resume: dict[str, Any] | None) -> Tracker:
    run_name = logging_cfg.run_name or Path(output_dir).absolute().name
    if name == "mlflow":
        return MLflowTracker(tracking_uri=logging_cfg.mlflow.tracking_uri or default_mlflow_uri(output_dir),
                             experiment=logging_cfg.experiment or DEFAULT_EXPERIMENT, run_name=run_name,
                             params=params, resume=resume, tags={"ft_framework.run.output_dir": str(output_dir)})
    wb = logging_cfg.wandb
    return WandbTracker(project=wb.project, entity=wb.entity, group=logging_cfg.experiment, run_name=run_name,
                        mode=wb.mode, directory=Path(wb.dir) if wb.dir else Path(output_dir), params=params,
                        resume=resume)


def open_trackers(cfg: Any, *, enabled: bool = True, resuming: bool = False) -> list[Tracker]:
    """The MLflow / W&B trackers `cfg.logging.report_to` names (TensorBoard is MetricsLogger's own),
    opened on the main process only; their run ids go to <output_dir>/trackers.json. With
    `resuming`, the runs recorded there are continued."""
    names = [n for n in (cfg.logging.report_to or ()) if n in ("mlflow", "wandb")]
    if not enabled or not names:
        return []
    output_dir = Path(cfg.logging.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    saved = _read_state(output_dir) if resuming else {}
    params = flatten_dotted(cfg.to_dict())
    trackers = [_open(name, cfg.logging, output_dir, params, saved.get(name)) for name in names]
    _write_state(output_dir, trackers)
    return trackers


def scalars_for_trackers(scalars: dict[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in scalars.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def log_artifacts_to_run(output_dir: str | Path, paths: Sequence[str | Path], logging_cfg: Any = None) -> list[str]:
    """Attaches files (ft-interpolate's and ft-report's PNGs) to the tracker runs recorded in
    <output_dir>/trackers.json; returns the trackers that got them. Missing packages are skipped."""
    saved = _read_state(Path(output_dir))
    done = []
    if "mlflow" in saved and importlib.util.find_spec("mlflow") is not None:
        from mlflow.tracking import MlflowClient

        entry = saved["mlflow"]
        _prepare_mlflow_uri(entry["tracking_uri"])
        client = MlflowClient(entry["tracking_uri"])
        for p in paths:
            client.log_artifact(entry["run_id"], str(p))
        done.append("mlflow")
    if "wandb" in saved and importlib.util.find_spec("wandb") is not None:
        import wandb

        entry = saved["wandb"]
        run = wandb.init(project=entry.get("project"), id=entry["id"], resume="allow", dir=entry.get("dir"),
                         mode=entry.get("mode", "offline"),
                         settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
                         reinit="create_new")
        for p in paths:
            run.save(str(p), base_path=str(Path(p).parent), policy="now")
        run.finish()
        done.append("wandb")
    return done
