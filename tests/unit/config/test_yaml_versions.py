"""A config means the same under every PyYAML release we allow: the YAML loader's tests run again under
each release requirements/pyyaml-versions.txt lists (the oldest pyproject.toml allows, the last
before 6.0.4 changed nested merges, the locked one), each imported from its own directory under
build/pyyaml/ (scripts/install.sh --test installs them there), in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[3]
VERSIONS = REPO / "requirements" / "pyyaml-versions.txt"
LOCK = REPO / "requirements" / "lock.txt"
# Every test of what a YAML file means: merges, duplicate keys, aliases, nesting, the file's encoding.
HOSTILE = "tests/unit/config/test_config_hostile.py::"
YAML_TESTS = ["tests/unit/config/test_yaml_merges.py", "tests/unit/config/test_config_untrusted.py",
              f"{HOSTILE}test_a_real_duplicate_is_named_where_it_is_written",
              f"{HOSTILE}test_a_config_nested_3000_deep_is_one_line",
              f"{HOSTILE}test_an_override_value_nested_3000_deep_is_one_line",
              f"{HOSTILE}test_a_latin1_config_names_file_line_and_byte"]


def listed() -> list[str]:
    return [line.strip() for line in VERSIONS.read_text().splitlines() if line.strip() and not line.startswith("#")]


def test_the_list_spans_the_releases_we_allow_and_lock():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    [pyyaml] = [Requirement(d) for d in deps if Requirement(d).name.lower() == "pyyaml"]
    [lower] = [spec.version for spec in pyyaml.specifier if spec.operator == ">="]
    locked = [line.split("==")[1] for line in LOCK.read_text().splitlines() if line.lower().startswith("pyyaml==")]
    versions = listed()
    assert versions[0] == lower, f"{VERSIONS}: the first release must be pyproject.toml's lower bound {lower}"
    assert locked and versions[-1] == locked[0], f"{VERSIONS}: the last release must be the locked one {locked}"
    assert "6.0.3" in versions and "6.0.4" in versions  # either side of the merge change


@pytest.mark.parametrize("version", listed())
def test_the_yaml_tests_pass_under(version):
    target = REPO / "build" / "pyyaml" / version
    assert (target / "yaml" / "__init__.py").is_file(), (
        f"PyYAML {version} is not installed in {target}: run bash scripts/install.sh --test")
    check = ("import sys, yaml\n"
             f"assert yaml.__version__ == {version!r} and yaml.__file__.startswith({str(target)!r}), yaml.__file__\n"
             "import pytest\n"
             f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', *{YAML_TESTS!r}]))\n")
    # No plugin takes part in these tests; loading hypothesis and the rest would double the time.
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
           "PYTHONPATH": os.pathsep.join([str(target), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-c", check], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"under PyYAML {version}:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert " passed" in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
