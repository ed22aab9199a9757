"""Every way a run ends other than "finished", as a user meets it: one row per case.

A row is what the user does (command-line overrides, edits to a data file, a checkpoint or the
environment) and what they must see: the exit code, fragments of the output, and never a Python
traceback unless the row says so (a crash keeps its traceback; --debug asks for one).

Exit codes (ft_framework/failures.py): 0 finished, 1 crashed, 2 user error, 3 diverged.

Most rows call `ft_framework.cli.train_main` in this process with its output captured (the CLI
is the same function the console script runs); the rows that need a clean environment or two
ranks run `ft-train` (or torchrun) as a subprocess.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from unittest import mock

import pytest

from tiny_run import write_run_config
from ft_framework import cli
from ft_framework.resources import quickstart_glue_dir

pytestmark = pytest.mark.slow
EXIT_OK, EXIT_CRASH, EXIT_USER_ERROR, EXIT_DIVERGED = 0, 1, 2, 3
KILLED = 137  # a row that simulates kill -9


# --------------------------------------------------------------------------------------------------
# What a row can do before the run: each returns extra overrides
# --------------------------------------------------------------------------------------------------


@dataclass
class Ctx:
    """A row's working directory, the run config written there, and the shared previous run."""

    tmp: Path
    config: Path
    out: Path
    model: Path
    previous_run: Path

    def copy_previous_run(self) -> None:
        shutil.copytree(self.previous_run, self.out)


def _data(edit_file: str, edit: Callable[[bytes], bytes]):
    """A copy of the quickstart SST-2 files with `edit_file` rewritten by `edit`."""
    def prepare(ctx: Ctx) -> list[str]:
        root = ctx.tmp / "glue"
        shutil.copytree(quickstart_glue_dir() / "SST-2", root / "SST-2")
        path = root / "SST-2" / edit_file
        path.write_bytes(edit(path.read_bytes()))
        return [f"data.source={root}"]
    return prepare


def _replace_line(n: int, new: bytes) -> Callable[[bytes], bytes]:
    def edit(text: bytes) -> bytes:
        lines = text.split(b"\n")
        lines[n - 1] = new
        return b"\n".join(lines)
    return edit


def _header_only(text: bytes) -> bytes:
    return text.split(b"\n")[0] + b"\n"


OWN_DATA = Path(__file__).resolve().parents[2] / "examples" / "data" / "reviews"


def _own_data(suffix: str, edit_file: str, edit: Callable[[bytes], bytes]):
    """Your own data (data.source: files): the example reviews in `suffix` form, `edit_file` rewritten."""
    columns = {".csv": ("text", "label"), ".jsonl": ("review", "sentiment")}[suffix]

    def prepare(ctx: Ctx) -> list[str]:
        root = ctx.tmp / "own"
        root.mkdir()
        for stem in ("train", "dev"):
            shutil.copy(OWN_DATA / f"{stem}{suffix}", root / f"{stem}{suffix}")
        path = root / edit_file
        path.write_bytes(edit(path.read_bytes()))
        return ["data.task=null", "data.source=files", f"data.files={{train: {root}/train{suffix}, "
                f"validation: {root}/dev{suffix}}}", f"data.text_columns=[{columns[0]}]",
                f"data.label_column={columns[1]}", "data.labels=[negative, positive]"]
    return prepare


def _previous_run(ctx: Ctx) -> list[str]:
    ctx.copy_previous_run()
    return []


def _corrupt_checkpoint(ctx: Ctx) -> list[str]:
    ctx.copy_previous_run()
    step = ctx.out / "checkpoints" / (ctx.out / "checkpoints" / "latest").read_text().strip()
    # The model's or optimizer's file, whatever the strategy's layout (not the trainer's state).
    target = next(f for f in sorted(step.rglob("*")) if f.is_file() and f.name not in ("COMPLETE", "trainer_state.pt"))
    target.write_bytes(b"garbage")
    return []


def _offline_hub_env(ctx: Ctx) -> dict[str, str]:
    return {"HF_HOME": str(ctx.tmp / "hf_home"), "HF_HUB_CACHE": str(ctx.tmp / "hf_home" / "hub")}


# --------------------------------------------------------------------------------------------------
# What a row checks after the run, besides exit code and output
# --------------------------------------------------------------------------------------------------


def _results(ctx: Ctx) -> dict:
    return json.loads((ctx.out / "results.json").read_text())


def _check_diverged(ctx: Ctx, output: str) -> None:
    results = _results(ctx)
    assert results["failed"] is True
    assert results["diverged"]["step"] >= 1
    assert "nan" in results["diverged"]["what"] or "inf" in results["diverged"]["what"]


def _check_changes(*expected: str, step: int = 2, by: str = "allowed on resume"):
    def check(ctx: Ctx, output: str) -> None:
        changes = {c["key"]: c for c in _results(ctx)["config_changes"]}
        for key in expected:
            assert key in changes, (key, changes)
            assert changes[key]["step"] == step
        assert changes[expected[0]]["allowed_by"] == by
    return check


def _check_moved_aside(ctx: Ctx, output: str) -> None:
    aside = list(ctx.out.glob("overwritten-*"))
    assert len(aside) == 1, list(ctx.out.iterdir())
    assert (aside[0] / "results.json").is_file() and (aside[0] / "metrics.jsonl").is_file()
    assert (aside[0] / "checkpoints").is_dir()
    # The new metrics.jsonl holds only the new run: one train record per step of 3.
    records = [json.loads(line) for line in (ctx.out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "train"] == [1, 2, 3]


def _check_no_orphan_marker(ctx: Ctx, output: str) -> None:
    ckpts = ctx.out / "checkpoints"
    for step in ckpts.glob("step_*"):
        if (step / "COMPLETE").is_file():
            assert (step / "trainer_state.pt").is_file(), f"{step.name} holds only its COMPLETE marker"
    # ...and the run resumes from its latest checkpoint.
    code, text = run_in_process(ctx, [*KILL_DURING_PRUNING, RESUME])
    assert code == EXIT_OK, text[-3000:]


# ---- rows that run something else than ft-train: (code, output) ----------------------------------


def _captured(fn, *args) -> tuple[int, str]:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        try:
            code = fn(*args)
        except BaseException:
            code = EXIT_CRASH
            buffer.write(traceback.format_exc())
    return code, buffer.getvalue()


def _report_of_previous_run(ctx: Ctx) -> tuple[int, str]:
    """ft-report on a run of the quickstart data limited to 64 training examples."""
    ctx.copy_previous_run()
    return _captured(cli.report_main, [str(ctx.out), "--no-plots", "--out", str(ctx.tmp / "report")])


def _sweep_with_a_diverged_run(ctx: Ctx) -> tuple[int, str]:
    """A store with a finished run and one that the runner runs (ft-train in a subprocess) and
    that diverges; then ft-report on the store."""
    from ft_framework.config import load_config
    from ft_framework.sweep.grid import PlannedRun
    from ft_framework.sweep.runners import execute_run
    from ft_framework.sweep.spec import RunnerSpec
    from ft_framework.sweep.store import SweepStore

    store = SweepStore(ctx.tmp / "sweep")
    runs = []
    for run_id, overrides in (("finished0001", []),
                              ("diverged0001", ["optimizer.hparams.pretrain_cof=1e6", "training.max_steps=10"])):
        cfg = load_config(ctx.config, [*overrides, f"logging.output_dir={store.run_dir(run_id)}"])
        runs.append(PlannedRun(run_id=run_id, method="recadam", axes={"data.task": "sst2"}, config=cfg))
    store.sync(runs)
    for name in ("results.json", "metrics.jsonl"):  # as a finished attempt leaves them
        shutil.copy(ctx.previous_run / name, store.run_dir("finished0001") / name)
    store.write_status("finished0001", state="finished", attempts=1)
    state = execute_run(store, runs[1], RunnerSpec(), env={"OMP_NUM_THREADS": "1"})
    counts = store.write_index(runs)
    status = store.read_status("diverged0001")
    code, report = _captured(cli.report_main, [str(store.root), "--no-plots"])
    again = [r.run_id for r in runs if not store.is_done(r.run_id)]  # what a re-run of the sweep would run
    return code, (f"state: {state}; error: {status.get('error')}; diverged: {counts['diverged']}, "
                  f"failed: {counts['failed']}; to run again: {again}\n{report}")


# --------------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    id: str
    overrides: tuple[str, ...] = ()
    code: int = EXIT_USER_ERROR
    says: tuple[str, ...] = ()
    prepare: Callable[[Ctx], list[str]] | None = None
    check: Callable[[Ctx, str], None] | None = None
    how: str = "in-process"            # or "subprocess", "torchrun", "report"
    env: Callable[[Ctx], dict[str, str]] | None = None
    argv: tuple[str, ...] = ()         # before the overrides: --debug
    traceback: bool = False            # the output may show a traceback
    not_says: tuple[str, ...] = ()
    within_s: float | None = None
    patch: Callable[[], contextlib.AbstractContextManager] | None = None
    exactly_once: tuple[str, ...] = field(default=())
    call: Callable[[Ctx], tuple[int, str]] | None = None   # how="call": runs this instead of ft-train


def _kill_during_prune():
    """Pruning an old checkpoint is "killed" (SystemExit 137) halfway: its files are deleted, in
    whatever order rmtree takes them, all but the COMPLETE marker (if it is still there)."""
    import ft_framework.checkpointing.manager as checkpoint

    real = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        path = Path(path)
        if path.name.startswith("step_") and path.is_dir():
            for f in path.rglob("*"):
                if f.is_file() and f.name != "COMPLETE":
                    f.unlink()
            raise SystemExit(KILLED)
        return real(path, *args, **kwargs)

    return mock.patch.object(checkpoint.shutil, "rmtree", rmtree)


def _no_gpu():
    """A machine without a CUDA device, also where the tests run on one."""
    return mock.patch("torch.cuda.is_available", return_value=False)


RESUME = "checkpoint.resume_from=latest"
LONGER = "training.max_steps=3"
KILL_DURING_PRUNING = ("training.max_steps=3", "checkpoint.every_steps=1", "checkpoint.keep_last=1")

ROWS = [
    # ---- the config, checked when it is loaded ------------------------------------------------
    Row("unknown_key", ("training.max_stepz=3",), says=("max_stepz", "did you mean 'max_steps'")),
    Row("negative_lr", ("optimizer.hparams.lr=-0.001",), says=("lr must be >= 0", "-0.001")),
    Row("debug_shows_traceback", ("optimizer.hparams.lr=-0.001",), argv=("--debug",), traceback=True,
        says=("Traceback", "lr must be >= 0")),
    Row("data_dir_missing", ("data.source=/nonexistent/glue",), says=("data.source", "/nonexistent/glue")),
    Row("allow_list_typo", (RESUME, "checkpoint.allow_config_change=[optimizer.hparams.lrr]"),
        prepare=_previous_run, says=("optimizer.hparams.lrr", "did you mean 'optimizer.hparams.lr'")),
    # ---- the machine ----------------------------------------------------------------------------
    Row("cuda_device_without_gpu", ("training.device=cuda",), patch=_no_gpu,
        says=("training.device is 'cuda' but no CUDA device is available", "use 'auto' or 'cpu'")),
    Row("fp16_on_cpu", ("training.device=cpu", "training.precision=fp16"),
        says=("training.precision fp16 needs a CUDA device", "use bf16 or fp32 on CPU")),
    # ---- the model ------------------------------------------------------------------------------
    Row("max_seq_length_too_long", ("data.max_seq_length=100000",),
        says=("data.max_seq_length", "100000", "max_position_embeddings: 128")),
    Row("missing_model_directory", ("model.name_or_path=/nonexistent/models/tiny-bert",),
        says=("model.name_or_path", "directory '/nonexistent/models/tiny-bert' not found"), not_says=("hub id'",)),
    Row("hub_model_offline", ("model.name_or_path=nonexistent-org/tiny-bert",),
        env=lambda ctx: {**_offline_hub_env(ctx), "HF_HUB_OFFLINE": "1"},
        says=("nonexistent-org/tiny-bert", "HF_HUB_OFFLINE"), within_s=10),
    Row("hub_unreachable", ("model.name_or_path=nonexistent-org/tiny-bert",),
        env=lambda ctx: {**_offline_hub_env(ctx), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9",
                         "HTTPS_PROXY": "", "HTTP_PROXY": "", "ALL_PROXY": "",
                         "https_proxy": "", "http_proxy": "", "all_proxy": ""},
        says=("nonexistent-org/tiny-bert", "cannot be reached"), within_s=10),
    # ---- the data -------------------------------------------------------------------------------
    Row("tsv_without_label_column", prepare=_data("train.tsv", _replace_line(1, b"sentence\tpolarity")),
        says=("train.tsv", "missing column 'label'")),
    Row("tsv_label_out_of_range", prepare=_data("train.tsv", _replace_line(3, b"a fine cafe .\t7")),
        says=("train.tsv:3", "'7'", "'0', '1'")),
    Row("tsv_empty_file", prepare=_data("train.tsv", lambda _: b""), says=("train.tsv", "empty")),
    Row("train_header_only", prepare=_data("train.tsv", _header_only), says=("train.tsv", "no examples")),
    Row("dev_header_only", prepare=_data("dev.tsv", _header_only), says=("dev.tsv", "no examples")),
    Row("tsv_not_utf8", prepare=_data("train.tsv", _replace_line(3, b"caf\xe9 noir .\t1")),
        says=("train.tsv:3", "UTF-8")),
    # ---- resuming -------------------------------------------------------------------------------
    Row("own_csv_unknown_label", prepare=_own_data(".csv", "train.csv", _replace_line(5, b"4,a fine cafe .,postive")),
        says=("train.csv:5", "unknown label 'postive' in column 'label'", "'negative', 'positive'")),
    Row("own_jsonl_malformed_line", prepare=_own_data(".jsonl", "dev.jsonl", _replace_line(3, b'{"review": "ok"')),
        says=("dev.jsonl:3", "not valid JSON")),
    # (one data.files override names the missing file: an override inside another's section is refused)
    Row("own_data_file_missing", prepare=lambda ctx: [
        arg.replace(f"validation: {ctx.tmp / 'own'}/dev.csv", "validation: /nonexistent/dev.csv")
        for arg in _own_data(".csv", "train.csv", lambda text: text)(ctx)],
        says=("data.files.validation", "'/nonexistent/dev.csv' not found")),
    Row("own_data_key_with_glue", ("data.text_columns=[sentence]",),
        says=("data.text_columns", "data.source: files")),
    Row("resume_without_checkpoint", (RESUME,), says=("holds no checkpoint",)),
    # The manifest's sizes name the damaged file (checkpointing/manifest.py: check_files).
    Row("resume_corrupt_checkpoint", (RESUME, LONGER), prepare=_corrupt_checkpoint,
        says=("is damaged:", "the manifest records", "(truncated or replaced)")),
    Row("resume_changed_lr", (RESUME, LONGER, "optimizer.hparams.lr=0.002"), prepare=_previous_run,
        says=("optimizer.hparams.lr: 0.001 -> 0.002", "checkpoint.allow_config_change")),
    Row("resume_changed_optimizer", (RESUME, LONGER, "optimizer.name=adamw", "optimizer.hparams={lr: 0.001}"),
        prepare=_previous_run, says=('optimizer.name: "recadam" -> "adamw"',)),
    Row("resume_changed_seed", (RESUME, LONGER, "training.seed=7"), prepare=_previous_run,
        says=("training.seed: 1 -> 7",)),
    Row("resume_shorter", (RESUME, "training.max_steps=1"), prepare=_previous_run,
        says=("training.max_steps: 2 -> 1", "only get longer")),
    Row("resume_allowed_changes", (RESUME, LONGER, "logging.log_every_steps=2", "evaluation.batch_size=8"),
        prepare=_previous_run, code=EXIT_OK,
        check=_check_changes("training.max_steps", "logging.log_every_steps", "evaluation.batch_size")),
    Row("resume_user_allowed_lr", (RESUME, LONGER, "optimizer.hparams.lr=0.002",
                                   "checkpoint.allow_config_change=[optimizer.hparams.lr]"),
        prepare=_previous_run, code=EXIT_OK,
        check=_check_changes("optimizer.hparams.lr", by="checkpoint.allow_config_change")),
    Row("resume_same_global_batch_split_otherwise", (RESUME, LONGER, "training.per_device_batch_size=4",
                                                     "training.gradient_accumulation_steps=2"),
        prepare=_previous_run, code=EXIT_OK,
        check=_check_changes("training.per_device_batch_size", "training.gradient_accumulation_steps")),
    Row("resume_changed_global_batch", (RESUME, LONGER, "training.per_device_batch_size=16"), prepare=_previous_run,
        says=("training.global_batch_size: 8 -> 16",)),
    # ---- the output directory -------------------------------------------------------------------
    Row("output_dir_in_use", (LONGER,), prepare=_previous_run,
        says=("holds a previous run", "checkpoint.resume_from=latest", "logging.output_dir", "logging.overwrite=true")),
    Row("overwrite_moves_old_files_aside", (LONGER, "logging.overwrite=true"), prepare=_previous_run,
        code=EXIT_OK, check=_check_moved_aside),
    # ---- divergence -----------------------------------------------------------------------------
    Row("diverged", ("optimizer.hparams.pretrain_cof=1e6", "training.max_steps=10"), code=EXIT_DIVERGED,
        says=("diverged at step", "nan"), check=_check_diverged),
    Row("no_overshoot_warning_for_constant_anneal",
        ("optimizer.hparams.anneal_fun=constant", "optimizer.hparams.pretrain_cof=1e6", "training.max_steps=2"),
        code=EXIT_OK, not_says=("PullOvershootWarning", "overshoots theta*")),
    Row("sweep_records_diverged_apart_from_failed", how="call", call=_sweep_with_a_diverged_run, code=EXIT_OK,
        says=("state: diverged", "error: diverged at step", "diverged: 1, failed: 0", "to run again: []",
              "1 diverged", "recadam diverged runs | 1/2", "recadam failed runs | "), within_s=120),
    # ---- ft-report ------------------------------------------------------------------------------
    Row("report_uses_the_actual_train_size", how="call", call=_report_of_previous_run, code=EXIT_OK,
        says=("SST-2 64 ", "none > 10k; SST-2 < 10k"), not_says=("SST-2 67k",)),
    # ---- checkpoint pruning ---------------------------------------------------------------------
    Row("kill_during_pruning", KILL_DURING_PRUNING,
        code=KILLED, patch=_kill_during_prune, check=_check_no_orphan_marker),
    # ---- several ranks: rank 1 fails, every rank exits, the error is shown once -----------------
    # (torchrun's own ChildFailedError report is left out of these rows' output: it is the launcher's.)
    Row("two_ranks_rank1_fails_in_setup", ("strategy.name=ddp", "training.per_device_batch_size=4"),
        how="torchrun", env=lambda ctx: {"FT_TEST_FAIL": "setup"}, code=None,
        exactly_once=("ft-train (rank 1): error: train.tsv: bad data on this node (rank 1)",),
        says=("ft-train (rank 0): stopped: another rank failed or went away (rank 1 shows its error)",), within_s=150),
    # A crash keeps its traceback, once: the failing rank's. The peer says one line.
    Row("two_ranks_rank1_fails_mid_training", ("strategy.name=ddp", "training.per_device_batch_size=4",
                                               "training.max_steps=6"),
        how="torchrun", env=lambda ctx: {"FT_TEST_FAIL": "step"}, code=None, traceback=True,
        exactly_once=("RuntimeError: out of memory (injected on rank 1 at step 3)", "Traceback"),
        says=("ft-train (rank 0): stopped: another rank failed or went away (rank 1 shows its error)",), within_s=150),
]


# --------------------------------------------------------------------------------------------------
# Running a row
# --------------------------------------------------------------------------------------------------


def run_in_process(ctx: Ctx, overrides, argv=(), env=None, patch=None) -> tuple[int, str]:
    """cli.train_main with stdout, stderr, log records and warnings captured into one text."""
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.dict(os.environ, env or {}))
            stack.enter_context(contextlib.redirect_stdout(buffer))
            stack.enter_context(contextlib.redirect_stderr(buffer))
            caught = stack.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("always")
            if patch is not None:
                stack.enter_context(patch())
            try:
                code = cli.train_main([*argv, "--config", str(ctx.config), *overrides])
            except SystemExit as exc:
                code = exc.code
            except BaseException:  # what the console script would print: a traceback
                code = EXIT_CRASH
                buffer.write(traceback.format_exc())
            for w in caught:
                buffer.write(f"{w.category.__name__}: {w.message}\n")
    finally:
        root.removeHandler(handler)
    return code, buffer.getvalue()


FAULTY_LAUNCHER = '''\
import os, sys
from ft_framework import trainer
from ft_framework.cli import train_main
from ft_framework.errors import UserError

if os.environ.get("RANK") == "1":
    if os.environ["FT_TEST_FAIL"] == "setup":
        from ft_framework.task_kinds import classification
        def load_data(self, *args, **kwargs):
            raise UserError("train.tsv: bad data on this node (rank 1)")
        classification.SequenceClassificationKind.load_data = load_data
    else:
        set_lr = trainer.Trainer._set_lr
        def failing_set_lr(self, step):
            if step == 2:
                raise RuntimeError("out of memory (injected on rank 1 at step 3)")
            return set_lr(self, step)
        trainer.Trainer._set_lr = failing_set_lr
sys.exit(train_main())
'''


def run_subprocess(ctx: Ctx, row: Row, env: dict[str, str]) -> tuple[int, str]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    if row.how == "torchrun":
        launcher = ctx.tmp / "faulty_train.py"
        launcher.write_text(FAULTY_LAUNCHER)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(launcher), "--config", str(ctx.config), *row.overrides]
    else:
        cmd = [sys.executable, "-m", "ft_framework.cli", *row.argv, "--config", str(ctx.config), *row.overrides]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ctx.tmp, env=full_env,
                         timeout=row.within_s or 300)
    return out.returncode, _without_launcher_report(out.stdout + out.stderr)


def _without_launcher_report(output: str) -> str:
    """The output less torchrun's closing ChildFailedError traceback and failure table."""
    start = output.rfind("Traceback (most recent call last):")
    if start >= 0 and "ChildFailedError" in output[start:] and "torch/distributed/run.py" in output[start:]:
        return output[:start]
    return output


@pytest.fixture(scope="module")
def previous_run(tiny_bert_dir, tmp_path_factory):
    """A finished 2-step run with a checkpoint at step 2, copied by the rows that need one."""
    tmp = tmp_path_factory.mktemp("previous")
    config = write_run_config(tmp / "run.yaml", tiny_bert_dir, tmp / "out", training={"max_steps": 2},
                              checkpoint={"every_steps": 2}, evaluation={"num_evals": 1, "batch_size": 16})
    code, text = run_in_process(Ctx(tmp, config, tmp / "out", tiny_bert_dir, tmp / "out"), [])
    assert code == EXIT_OK, text[-3000:]
    return tmp / "out"


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_row(row: Row, tiny_bert_dir, previous_run, tmp_path):
    out = tmp_path / "out"
    config = write_run_config(tmp_path / "run.yaml", tiny_bert_dir, out, training={"max_steps": 2},
                              evaluation={"num_evals": 1, "batch_size": 16})
    ctx = Ctx(tmp_path, config, out, tiny_bert_dir, previous_run)
    extra = row.prepare(ctx) if row.prepare else []
    env = row.env(ctx) if row.env else {}
    row = Row(**{**row.__dict__, "overrides": (*row.overrides, *extra)})
    started = time.monotonic()
    if row.how == "in-process":
        code, output = run_in_process(ctx, row.overrides, row.argv, env, row.patch)
    elif row.how == "call":
        code, output = row.call(ctx)
    else:
        code, output = run_subprocess(ctx, row, env)
    seconds = time.monotonic() - started
    shown = output[-4000:]
    if row.code is not None:
        assert code == row.code, shown
    else:
        assert code not in (0, None), shown
    for fragment in row.says:
        assert fragment in output, (fragment, shown)
    for fragment in row.not_says:
        assert fragment not in output, (fragment, shown)
    for fragment in row.exactly_once:
        assert output.count(fragment) == 1, (fragment, output.count(fragment), shown)
    if not row.traceback:
        assert "Traceback" not in output, shown
    if row.code == EXIT_USER_ERROR and not row.traceback:
        errors = [line for line in output.splitlines() if line.startswith("ft-train") and "error:" in line]
        assert len(errors) == 1, shown
    if row.within_s is not None:
        assert seconds < row.within_s, seconds
    if row.check is not None:
        row.check(ctx, output)
