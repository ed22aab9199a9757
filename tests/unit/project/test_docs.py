"""The documentation stays true to the repository: nothing points outside it, and the files, configs
and modules the docs name exist."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
# Spelled in pieces so that this file does not match itself.
OUTSIDE_PATHS = ("shared" + "/spec", ".." + "/shared")


def tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [REPO / name for name in out.decode().split("\0") if name]


def test_no_tracked_file_points_outside_the_repository():
    hits = []
    for path in tracked_files():
        if path.suffix == ".tsv" or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary
        for lineno, line in enumerate(text.splitlines(), 1):
            if any(s in line for s in OUTSIDE_PATHS):
                hits.append(f"{path.relative_to(REPO)}:{lineno}: {line.strip()[:120]}")
    assert not hits, "paths outside the repository:\n" + "\n".join(hits)


# Two pytest-xdist workers for the CI machine's 2 cores; tests/conftest.py groups the tests so
# that --dist loadgroup sets each module's (and tests/multinode's) fixtures up once.
TEST_COMMAND = "python3 -m pytest -q -n 2 --dist loadgroup"


def test_readme_keeps_the_two_setup_commands_and_ci_runs_the_test_command():
    readme = (REPO / "README.md").read_text()
    assert "bash scripts/install.sh && ft-train --config configs/quickstart.yaml" in readme
    assert f"bash scripts/install.sh --test && {TEST_COMMAND}" in readme
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert "bash scripts/install.sh --test" in ci and TEST_COMMAND in ci


def test_files_named_in_readme_and_docs_exist():
    texts = {path.relative_to(REPO).as_posix(): path.read_text()
             for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]}
    missing = []
    pattern = re.compile(r"(?<![\w/.-])((?:configs|docs|benchmarks|scripts|launch|cpp|ft_framework|tests)"
                         r"/[\w./-]*[\w/])")
    for name, text in texts.items():
        for ref in set(pattern.findall(text)):
            if "*" in ref or not list(REPO.glob(ref.rstrip("/"))):
                if "*" in ref and list(REPO.glob(ref)):
                    continue
                missing.append(f"{name}: {ref}")
    assert not missing, "named but not in the repository:\n" + "\n".join(sorted(missing))


def test_modules_in_the_design_ownership_table_exist():
    text = (REPO / "docs" / "design.md").read_text()
    table = text.split("## Which module owns what", 1)[1].split("\n## ", 1)[0]
    missing = []
    for ref in set(re.findall(r"`([\w/]+(?:\.py|\.h|/))`", table)):
        candidates = [REPO / "ft_framework" / ref, REPO / ref]
        if not any(c.exists() for c in candidates):
            missing.append(ref)
    assert not missing, f"docs/design.md names modules that do not exist: {sorted(missing)}"
    # Every library module is owned by some row (sub-packages may be named as a whole).
    named = {re.sub(r"^ft_framework/", "", ref) for ref in re.findall(r"`([\w/]+(?:\.py|/))`", table)}
    unnamed = []
    for path in sorted((REPO / "ft_framework").rglob("*.py")):
        rel = path.relative_to(REPO / "ft_framework").as_posix()
        if path.name == "__init__.py" or "__pycache__" in rel:
            continue
        parents = {p.as_posix() + "/" for p in Path(rel).parents if p.as_posix() != "."}
        if rel not in named and not parents & named:
            unnamed.append(rel)
    assert not unnamed, (f"library modules without an owner row in docs/design.md: {unnamed}; "
                         "add each to the table under 'Which module owns what'")
