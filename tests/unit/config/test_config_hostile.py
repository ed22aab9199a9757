"""What a config (or the machine it starts on) can do that used to cost a traceback or a run, each now
one line before anything loads (issue 44):

- a config, or an override value, nested 3000 deep (PyYAML's composer recursed past Python's limit);
- a config saved as Latin-1 (UnicodeDecodeError), or a named pipe as the config (an alarm turns a
  blocked read into a failure);
- optimizer.impl=triton where the Triton step cannot run (a TypeError after the weights loaded);
- a task of a 2-task srun step under strategy single (it trained, a second writer of the run);
- a merge (`<<: *base`) with a key that overrides a merged one is valid YAML, not a duplicate, and a
  real duplicate is named at the place it is written.
"""

from __future__ import annotations

import os

import pytest
import torch
import yaml

from bounded import no_block
from ft_framework.cli import train_main
from ft_framework.config import ConfigError, load_config, parse_override
from ft_framework.config.yaml_loader import DuplicateKey, load_yaml, marks_text
from test_config import minimal, write

DEEP = "[" * 3000 + "]" * 3000


def one_line(message: str, *says: str) -> None:
    assert "\n" not in message.strip() and "Traceback" not in message, message
    for part in says:
        assert part in message, message


@pytest.fixture
def config(tmp_path):
    return write(tmp_path, minimal())


# ---- 7. nesting ------------------------------------------------------------------------------------
def test_a_config_nested_3000_deep_is_one_line(tmp_path, capsys):
    path = write(tmp_path, yaml.safe_dump(minimal()) + f"task_overrides: {DEEP}\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    one_line(str(refused.value), str(path), "nested deeper than 100 levels")
    assert train_main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ft-train: error: "), err


def test_an_override_value_nested_3000_deep_is_one_line():
    with pytest.raises(ConfigError) as refused:
        parse_override(f"training.seed={DEEP}")
    one_line(str(refused.value), "override", "nested deeper than 100 levels")


# ---- 8. the config file itself ---------------------------------------------------------------------
def test_a_latin1_config_names_file_line_and_byte(tmp_path, capsys):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(("# r\u00e9sum\u00e9 of the run\n" + yaml.safe_dump(minimal())).encode("latin-1"))
    assert train_main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    one_line(err, f"ft-train: error: {path}:1: not UTF-8 text (byte 0xe9 at byte offset 3, column 4)")


def test_a_named_pipe_as_the_config_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "run.yaml")
    with no_block("the config's named pipe was opened for reading"), pytest.raises(ConfigError) as refused:
        load_config(tmp_path / "run.yaml")
    one_line(str(refused.value), "is a named pipe, not a regular file")


# ---- 8. impl=triton where it cannot run ------------------------------------------------------------
@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_triton_on_the_cpu_is_refused_before_anything_loads(config, capsys, no_interpreter):
    with pytest.raises(ConfigError) as refused:
        load_config(config, ["optimizer.impl=triton", "training.device=cpu"])
    one_line(str(refused.value), "optimizer.impl: 'triton' steps CUDA tensors", "training.device: cpu")
    with pytest.raises(ConfigError, match="the offloaded optimizer steps on the CPU"):
        load_config(config, ["optimizer.impl=triton", "strategy.offload_optimizer={}"])
    # ft-train says it before the model (a hub id that is nowhere) is looked for.
    assert train_main(["--config", str(config), "optimizer.impl=triton", "training.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ft-train: error: optimizer.impl: 'triton'"), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks CUDA here: triton can run")
def test_triton_on_auto_without_a_gpu_is_refused(config, no_interpreter):
    with pytest.raises(ConfigError, match="this machine has no CUDA device"):
        load_config(config, ["optimizer.impl=triton"])


def test_triton_under_its_interpreter_runs_on_the_cpu(config, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert load_config(config, ["optimizer.impl=triton", "training.device=cpu"]).optimizer.impl == "triton"


# ---- 8. one task of a multi-task srun step ---------------------------------------------------------
SRUN_TASK_1_OF_2 = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
                    "SLURM_LOCALID": "1", "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "node1"}


@pytest.fixture
def srun_task(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in SRUN_TASK_1_OF_2.items():
        monkeypatch.setenv(name, value)
    return monkeypatch


def test_a_task_of_a_two_task_srun_step_under_single_is_refused(config, srun_task, capsys):
    with pytest.raises(ConfigError) as refused:
        load_config(config)
    one_line(str(refused.value), "task 1 of an srun step of 2 tasks", "strategy.name is single", "srun -n1")
    assert train_main(["--config", str(config)]) == 2
    assert capsys.readouterr().err.startswith("ft-train: error: this process is task 1 of an srun step of 2 tasks")
    # A distributed strategy takes the step's tasks as its ranks; one task alone is a plain run.
    assert load_config(config, ["strategy.name=ddp"]).strategy.name == "ddp"
    srun_task.setenv("SLURM_STEP_NUM_TASKS", "1")
    srun_task.setenv("SLURM_NTASKS", "1")
    assert load_config(config).strategy.name == "single"


# ---- 9. a duplicate beside merges (what merges mean: tests/unit/config/test_yaml_merges.py) -----------------------
@pytest.mark.parametrize("text, key, where", [
    ("a: &a {p: 1, p: 2}\nb: {<<: *a}\n", "a.p", "line 1, columns 8 and 14"),
    ("b: {<<: &a {p: 1, p: 2}}\n", "b.<<.p", "line 1, columns 13 and 19"),
    ("a: &a {p: 1}\nb:\n  <<: *a\n  q: 1\n  q: 2\n", "b.q", "lines 4 and 5"),
])
def test_a_real_duplicate_is_named_where_it_is_written(text, key, where, tmp_path):
    with pytest.raises(DuplicateKey) as found:
        load_yaml(text)
    assert found.value.key == key and marks_text(found.value.first, found.value.second) == where
    path = write(tmp_path, yaml.safe_dump(minimal()) + "extra:\n" + "".join(f"  {line}\n" for line in text.splitlines()))
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    one_line(str(refused.value), f"key 'extra.{key}' is given twice")


# ---- 6. a model directory naming its own code ------------------------------------------------------
def test_a_local_model_naming_its_own_code_is_refused_before_anything_loads(tmp_path, capsys, monkeypatch):
    """config.json with auto_map for a model type transformers does not ship: ft-train says so in one
    line when the config is loaded; transformers is never asked (its prompt calls input())."""
    model = tmp_path / "custom_model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "planted_type", "auto_map": {"AutoConfig": "planted.Config"}}')
    asked: list[str] = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "y")
    config = write(tmp_path, {**minimal(), "model": {"name_or_path": str(model)}})
    with pytest.raises(ConfigError) as refused:
        load_config(config)
    one_line(str(refused.value), "model.name_or_path: ", "names a model's own code (auto_map)", "'planted_type'")
    assert train_main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ft-train: error: model.name_or_path: ") and not asked, err
    # A type transformers ships loads with its own code: the auto_map is not used, the config passes.
    (model / "config.json").write_text('{"model_type": "bert", "auto_map": {"AutoConfig": "planted.Config"}}')
    assert load_config(config).model.name_or_path == str(model)
