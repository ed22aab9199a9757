"""A config file or override is untrusted input: a YAML "billion laughs" bomb, a duplicated key or a
huge value is refused in one short line with exit 2, fast and in little memory, never expanded,
silently half-read or quoted in full.

The bomb cases run in ONE child process (Python's start-up once, not per case) that calls the CLI's
own function, ``cli.train_main``, case after case; the child reports its own peak RSS (VmHWM) at
exit and the parent kills it at the deadline, so a bomb that does expand fails the test instead of
filling the machine. Two cases run through the real ``ft-train`` console script as well.
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from ft_framework.config import ConfigError, apply_overrides, load_config, parse_override
from ft_framework.config.yaml_loader import ALIAS_NODE_LIMIT
from ft_framework.errors import QUOTE_LIMIT, quoted
# A valid config (so only the case's value can make it fail); it is never trained.
from test_config import minimal as base_config

CASE_SECONDS = 5.0  # each case's limit (the issue's)
PEAK_RSS_MB = 300
LINE_CHARS = 300
# A safety net for the machine when the bound is missing: the address space a child may take.
CHILD_ADDRESS_SPACE = 4 << 30


def bomb(depth: int = 9, width: int = 9) -> str:
    """A flow sequence whose anchors nest `depth` deep, each alias list `width` wide: expanded, it
    holds width**depth strings (9x9: 387 million)."""
    levels = ["&l0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, depth):
        levels.append(f"&l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]")
    return "[" + ", ".join(levels) + "]"


PLACEHOLDER = "__VALUE__"
# A key of every section (a string, a number, a list, a free mapping; task_overrides' inner config).
BOMB_KEYS = [
    ("model", "name_or_path"), ("data", "labels"), ("optimizer", "hparams", "lr"), ("schedule", "warmup_ratio"),
    ("training", "seed"), ("evaluation", "num_evals"), ("strategy", "deepspeed", "config"),
    ("logging", "output_dir"), ("checkpoint", "allow_config_change"), ("task_overrides", "rte", "training"),
]
BOMB_OVERRIDES = ["training.seed", "optimizer.hparams", "data.files.train", "task_overrides.rte.training.seed"]


def config_text_with(path: tuple[str, ...], value_text: str) -> str:
    """The base config as YAML with `value_text` (YAML source) as the value at `path`."""
    data = base_config()
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = PLACEHOLDER
    return yaml.safe_dump(data, sort_keys=False).replace(PLACEHOLDER, value_text)


# Runs a Python script (argv[2:]) and, at its exit, writes the process's own peak RSS (VmHWM, in kB)
# to argv[1]. VmHWM belongs to the exec'd image alone; wait4's ru_maxrss would not do: Linux keeps
# in it the high-water mark of the image a child replaced at exec, here the forking pytest worker's.
HWM_WRAPPER = textwrap.dedent("""
    import atexit, runpy, sys
    def report(path=sys.argv[1]):
        with open("/proc/self/status") as status:
            hwm_kb = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
        with open(path, "w") as out:
            out.write(hwm_kb)
    atexit.register(report)
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
""")


def run_measured(script: list[str], cwd: Path, deadline_s: float) -> tuple[int, str, str, float, float]:
    """Runs the Python script `script[0]` with arguments `script[1:]`; returns (exit code, stdout,
    stderr, seconds, the child's own peak RSS in MB). Killed at `deadline_s` (exit code -9 then, and
    no peak: inf)."""
    out_path, err_path, hwm_path = cwd / "child.out", cwd / "child.err", cwd / "child.hwm"
    hwm_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-c", HWM_WRAPPER, str(hwm_path), *script]
    with out_path.open("w") as out, err_path.open("w") as err:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=err, preexec_fn=_limit_address_space)
        try:
            proc.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        elapsed = time.monotonic() - start
    peak_mb = int(hwm_path.read_text()) / 1024 if hwm_path.exists() else float("inf")
    return proc.returncode, out_path.read_text(), err_path.read_text(), elapsed, peak_mb


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_ADDRESS_SPACE, CHILD_ADDRESS_SPACE))


# The child: each case through cli.train_main with stderr captured, timed one by one.
CHILD = textwrap.dedent("""
    import contextlib, io, json, sys, time
    from ft_framework import cli
    results = []
    for case in json.load(open(sys.argv[1])):
        err = io.StringIO()
        start = time.monotonic()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli.train_main(case["argv"])
        results.append({"name": case["name"], "code": code, "stderr": err.getvalue(),
                        "seconds": time.monotonic() - start})
        print(json.dumps(results[-1]), flush=True)
""")


def hostile_cases(tmp_path: Path) -> list[dict]:
    """Each case's argv: config paths relative to `tmp_path`, the child's working directory (the
    message names the path as the user typed it)."""
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(base_config()))
    cases = []
    for path in BOMB_KEYS:
        config = tmp_path / f"bomb_{'_'.join(path)}.yaml"
        config.write_text(config_text_with(path, bomb()))
        cases.append({"name": f"bomb under {'.'.join(path)}", "argv": ["--config", config.name]})
    for key in BOMB_OVERRIDES:
        cases.append({"name": f"bomb as override {key}", "argv": ["--config", good.name, f"{key}={bomb()}"]})
    # Not bombs, but values and keys too long to quote whole.
    long_value = tmp_path / "long_value.yaml"
    long_value.write_text(config_text_with(("training", "seed"), "x" * 200_000))
    long_key = tmp_path / "long_key.yaml"
    long_key.write_text(config_text_with(("training", "y" * 200_000), "1"))
    long_list = tmp_path / "long_list.yaml"  # (PyYAML reads about 15k values a second: keep it short)
    long_list.write_text(config_text_with(("optimizer", "hparams", "betas"), "[" + ", ".join(["0.9"] * 3000) + "]"))
    long_int = tmp_path / "long_int.yaml"
    long_int.write_text(config_text_with(("training", "seed"), "9" * 5000))
    cases += [
        {"name": "a 200 kB value", "argv": ["--config", long_value.name]},
        {"name": "a 200 kB key", "argv": ["--config", long_key.name]},
        {"name": "a list of 3000 numbers", "argv": ["--config", long_list.name]},
        {"name": "an integer of 5000 digits", "argv": ["--config", long_int.name]},
        {"name": "a 200 kB override", "argv": ["--config", good.name, "data.task=" + "z" * 200_000]},
    ]
    return cases


def assert_one_short_line(name: str, stderr: str, limit: int = LINE_CHARS) -> None:
    lines = stderr.splitlines()
    assert len(lines) == 1, f"{name}: {len(lines)} lines: {stderr[:500]!r}"
    assert len(lines[0]) <= limit, f"{name}: a line of {len(lines[0])} characters: {lines[0][:400]!r}"
    assert lines[0].startswith("ft-train: error: "), f"{name}: {lines[0]!r}"
    assert "Traceback" not in stderr


def test_hostile_configs_exit_2_fast_in_one_short_line_and_little_memory(tmp_path):
    cases = hostile_cases(tmp_path)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    code, stdout, stderr, _, peak_mb = run_measured(
        [str(child), str(tmp_path / "cases.json")], tmp_path,
        deadline_s=10 + CASE_SECONDS * len(cases))
    results = [json.loads(line) for line in stdout.splitlines()]
    assert code == 0 and len(results) == len(cases), (
        f"the child ended with {code} after {len(results)} of {len(cases)} cases "
        f"(next: {cases[len(results)]['name'] if len(results) < len(cases) else '-'}): {stderr[-2000:]}")
    for result in results:
        assert result["code"] == 2, f"{result['name']}: exit {result['code']}: {result['stderr'][:500]!r}"
        assert result["seconds"] < CASE_SECONDS, f"{result['name']}: {result['seconds']:.1f} s"
        if result["name"].startswith("bomb"):
            assert_one_short_line(result["name"], result["stderr"])
        else:  # the value is quoted short; the line may also list the valid keys (ours, not the user's)
            assert_one_short_line(result["name"], result["stderr"], limit=LINE_CHARS + 300)
            assert not any(c * QUOTE_LIMIT in result["stderr"] for c in "xyz0"), result["stderr"]
    assert peak_mb < PEAK_RSS_MB, f"peak RSS {peak_mb:.0f} MB over the cases"
    bombs = [r for r in results if r["name"].startswith("bomb")]
    assert all(f"more than {ALIAS_NODE_LIMIT}" in r["stderr"] for r in bombs), [r["stderr"] for r in bombs]


@pytest.mark.parametrize("where", ["file", "override"])
def test_the_ft_train_console_script_refuses_a_bomb(tmp_path, where):
    ft_train = shutil.which("ft-train")
    if ft_train is None:
        pytest.skip("the ft-train console script is not on PATH (the package is not installed)")
    if where == "file":
        config = tmp_path / "bomb.yaml"
        config.write_text(config_text_with(("training", "seed"), bomb()))
        argv = ["--config", config.name]
    else:
        config = tmp_path / "good.yaml"
        config.write_text(yaml.safe_dump(base_config()))
        argv = ["--config", config.name, f"training.seed={bomb()}"]
    code, _, stderr, seconds, peak_mb = run_measured([ft_train, *argv], tmp_path, deadline_s=CASE_SECONDS)
    assert code == 2, (code, stderr[-2000:])
    assert seconds < CASE_SECONDS and peak_mb < PEAK_RSS_MB, (seconds, peak_mb)
    assert_one_short_line(where, stderr)
    assert f"more than {ALIAS_NODE_LIMIT}" in stderr


# --- the alias bound itself ----------------------------------------------------------------------


def test_aliases_within_the_bound_still_work(tmp_path):
    """Anchors and aliases (and merge keys) are YAML that configs may use, as long as they stay small."""
    text = config_text_with(("optimizer", "hparams"), "&h {lr: 3.0e-5}") + "task_overrides:\n  rte:\n    optimizer:\n      hparams: *h\n"
    path = tmp_path / "run.yaml"
    path.write_text(text)
    cfg = load_config(path, check_paths=False)
    assert cfg.optimizer.hparams["lr"] == pytest.approx(3e-5)


def test_aliases_past_the_bound_are_refused_and_a_recursive_alias_too(tmp_path):
    wide = "[" + ", ".join(["x"] * (ALIAS_NODE_LIMIT // 2)) + "]"
    path = tmp_path / "run.yaml"
    path.write_text(config_text_with(("data", "labels"), f"[&w {wide}, *w, *w, *w]"))
    with pytest.raises(ConfigError, match=rf"aliases expand to more than {ALIAS_NODE_LIMIT} nodes.*line \d+"):
        load_config(path, check_paths=False)
    path.write_text(config_text_with(("data", "labels"), "&r [a, *r]"))
    with pytest.raises(ConfigError, match="refers to the node that holds it"):
        load_config(path, check_paths=False)


# --- duplicate keys ------------------------------------------------------------------------------


@pytest.mark.parametrize("text, key, lines", [
    ("optimizer:\n  hparams:\n    lr: 1.0e-3\n    lr: 2.0e-5\n", "optimizer.hparams.lr", "lines 11 and 12"),
    ("optimizer:\n  hparams: {lr: 1.0e-3}\noptimizer:\n  name: adamw\n", "optimizer", "lines 9 and 11"),
    ("task_overrides:\n  rte:\n    training.seed: 1\n    training.seed: 2\n", "task_overrides.rte.training.seed",
     "lines 11 and 12"),
    ("evaluation: {num_evals: 2, num_evals: 3}\n", "evaluation.num_evals", "line 9, columns 14 and 28"),
])
def test_a_duplicate_key_is_refused_naming_it_and_both_lines(tmp_path, text, key, lines):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(base_config(), sort_keys=False).replace("optimizer:\n  hparams:\n    lr: 2.0e-05\n", "")
                    + text)
    with pytest.raises(ConfigError) as info:
        load_config(path, check_paths=False)
    message = str(info.value)
    assert f"key {key!r} is given twice ({lines})" in message and "\n" not in message, message


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(config_text_with(("optimizer", "hparams"), "{<<: {lr: 1.0e-5, anneal_k: 0.5}, lr: 3.0e-5}"))
    assert load_config(path, check_paths=False).optimizer.hparams["lr"] == pytest.approx(3e-5)


def test_a_duplicate_key_inside_an_override_value_is_refused():
    with pytest.raises(ConfigError, match=r"key 'lr' is given twice \(line 1, columns 2 and 11 of the value\)"):
        parse_override("optimizer.hparams={lr: 1.0, lr: 2.0}")


@pytest.mark.parametrize("overrides, message", [
    (["training.seed=1", "training.max_steps=3", "training.seed=2"],
     "override 'training.seed' (argument 3) repeats 'training.seed' (argument 1)"),
    (["optimizer.hparams={lr: 1.0}", "optimizer.hparams.lr=2.0"],
     "override 'optimizer.hparams.lr' (argument 2) lies inside 'optimizer.hparams' (argument 1)"),
    (["optimizer.hparams.lr=2.0", "optimizer.hparams={anneal_k: 1.0}"],
     "override 'optimizer.hparams' (argument 2) holds 'optimizer.hparams.lr' (argument 1)"),
])
def test_overrides_that_set_one_key_twice_are_refused(overrides, message):
    with pytest.raises(ConfigError) as info:
        apply_overrides(base_config(), overrides)
    assert message in str(info.value), str(info.value)


def test_overrides_of_different_keys_in_one_section_still_combine():
    data = apply_overrides(base_config(), ["optimizer.hparams.lr=1.0", "optimizer.hparams.anneal_k=0.5",
                                           "training.seed=3"])
    assert data["optimizer"]["hparams"] == {"lr": 1.0, "anneal_k": 0.5} and data["training"]["seed"] == 3


# --- the one quoting helper ----------------------------------------------------------------------


def test_quoted_shows_a_short_one_line_repr_of_anything():
    assert quoted("abc") == "'abc'" and quoted(3) == "3" and quoted([1, "a"]) == "[1, 'a']"
    for value in ["x" * 10**6, "a\nb" * 10**5, list(range(10**6)), {str(i): [i] * 50 for i in range(1000)}, 7 ** 9999,
                  b"\x00" * 10**6, {1.5, 2.5, 3.5}]:
        text = quoted(value)
        assert len(text) <= QUOTE_LIMIT and "\n" not in text, text
    nested: list = ["lol"] * 9
    for _ in range(9):  # shared, not expanded: 9**10 strings if walked in full
        nested = [nested] * 9
    start = time.monotonic()
    assert len(quoted(nested)) <= QUOTE_LIMIT and time.monotonic() - start < 0.5
