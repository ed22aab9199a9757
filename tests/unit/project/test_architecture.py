"""The import structure docs/design.md draws, enforced.

- `.importlinter` holds the contracts (layers, independent backends, a sweep that trains nothing,
  strategies that know no task kind, no cycle inside a package); import-linter checks them against
  the real import graph.
- Every module of ft_framework sits in a layer of the contract, so a new module cannot slip past it,
  and the layers are those of the picture in docs/design.md ("Layers"), line for line.
- No module imports one of our own modules inside a function: such an import hides a cycle from a
  reader (and from nothing else). Lazy imports of optional heavy third-party packages stay allowed,
  and so do cli.py's (the entry module defers each command's work past its --help).
"""

from __future__ import annotations

import ast
import configparser
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="import-linter is in the test extra: pip install -e '.[test]'")

REPO = Path(__file__).resolve().parents[3]
PACKAGE = REPO / "ft_framework"
CONTRACTS = REPO / ".importlinter"


def _modules() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def _lint(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()", "--config", str(config), "--no-cache"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_import_contracts_are_kept():
    result = _lint(CONTRACTS)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " 0 broken" in result.stdout, result.stdout[-3000:]


def test_a_broken_layer_is_reported(tmp_path):
    """The check can fail: the same layers turned upside down are broken."""
    parser = configparser.ConfigParser()
    parser.read(CONTRACTS)
    layers = [line for line in parser["importlinter:contract:layers"]["layers"].splitlines() if line.strip()]
    parser["importlinter:contract:layers"]["layers"] = "\n" + "\n".join(reversed(layers))
    for section in parser.sections():
        if section.startswith("importlinter:contract:") and section != "importlinter:contract:layers":
            parser.remove_section(section)
    upside_down = tmp_path / "contracts.ini"
    with open(upside_down, "w") as fh:
        parser.write(fh)
    result = _lint(upside_down)
    assert result.returncode != 0
    assert "ft_framework.trainer is not allowed to import" in result.stdout, result.stdout[-3000:]


def test_the_strategies_import_no_task_kind_and_the_check_can_fail(tmp_path):
    """strategies/ (the memory plan with them) is handed the task kind; it imports neither task_kinds/
    nor data/. The same contract over an arrow strategies/ does have (models.loading) is broken."""
    parser = configparser.ConfigParser()
    parser.read(CONTRACTS)
    name = "importlinter:contract:strategies-know-no-kind"
    contract = parser[name]
    assert contract["type"] == "forbidden" and contract["source_modules"].split() == ["ft_framework.strategies"]
    assert set(contract["forbidden_modules"].split()) == {"ft_framework.task_kinds", "ft_framework.data"}
    for section in parser.sections():
        if section.startswith("importlinter:contract:") and section != name:
            parser.remove_section(section)
    parser[name]["forbidden_modules"] = "\nft_framework.models.loading"
    planted = tmp_path / "contracts.ini"
    with open(planted, "w") as fh:
        parser.write(fh)
    result = _lint(planted)
    assert result.returncode != 0
    assert "ft_framework.strategies" in result.stdout and "ft_framework.models.loading" in result.stdout, \
        result.stdout[-3000:]


def test_every_module_is_in_a_layer():
    parser = configparser.ConfigParser()
    parser.read(CONTRACTS)
    layers = [m.strip() for line in parser["importlinter:contract:layers"]["layers"].splitlines()
              for m in line.replace(":", "|").split("|") if m.strip()]
    # A package split over several layers (run/, models/; the root) must import nothing itself.
    split = [m for m in _modules() if any(layer.startswith(m + ".") for layer in layers)]
    for package in split:
        init = (REPO / package.replace(".", "/") / "__init__.py").read_text()
        assert not any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.parse(init).body), package
    missing = [m for m in _modules() if m not in split
               and not any(m == layer or m.startswith(layer + ".") for layer in layers)]
    assert not missing, f"add these modules to a layer of .importlinter (and to docs/design.md): {missing}"


def _normalized(modules: list[str], separator: str) -> tuple[str | None, tuple[str, ...]]:
    return (separator if len(modules) > 1 else None), tuple(sorted(modules))


def _contract_layers() -> list[tuple[str | None, tuple[str, ...]]]:
    parser = configparser.ConfigParser()
    parser.read(CONTRACTS)
    out = []
    for line in parser["importlinter:contract:layers"]["layers"].splitlines():
        if line.strip():
            separator = ":" if ":" in line else "|"
            out.append(_normalized([m.strip() for m in line.split(separator)], separator))
    return out


def _module_of(path: str) -> str:
    """"run/files.py" -> "ft_framework.run.files"; "sweep/" -> "ft_framework.sweep"."""
    return "ft_framework." + path.strip().rstrip("/").removesuffix(".py").replace("/", ".")


def _design_layers() -> list[tuple[str | None, tuple[str, ...]]]:
    """The layers of docs/design.md's picture (its "Layers" section's code block): one layer a line,
    `a | b` independent modules, `dir/{a, b}.py` modules that may import each other."""
    text = (REPO / "docs" / "design.md").read_text()
    section = text[text.index("\n## Layers\n"):]
    block = section.split("```")[1]
    out = []
    for line in block.splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        if "{" in line:
            head, rest = line.split("{")
            names, tail = rest.split("}")
            out.append(_normalized([_module_of(f"{head}{n.strip()}{tail}") for n in names.split(",")], ":"))
        else:
            out.append(_normalized([_module_of(m) for m in line.split("|")], "|"))
    return out


def test_the_contract_is_the_picture_in_design_md():
    assert _design_layers() == _contract_layers()


def function_local_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of an ft_framework module inside a function of `source`; for
    `from PACKAGE import name` the module is PACKAGE.name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.ImportFrom) and (sub.level or (sub.module or "").split(".")[0] == "ft_framework"):
                base = "." * sub.level + (sub.module or "")
                found += [(sub.lineno, f"{base}.{a.name}".replace("..", ".")) for a in sub.names]
            elif isinstance(sub, ast.Import):
                found += [(sub.lineno, a.name) for a in sub.names if a.name.split(".")[0] == "ft_framework"]
    return sorted(set(found))


def test_the_scan_finds_a_function_local_import():
    source = ("import torch\nfrom ft_framework.errors import UserError\n"
              "def f():\n    import numpy\n    from ft_framework.config import load_config\n"
              "    def g():\n        import ft_framework.optim\n        from . import sibling\n")
    assert function_local_imports(source) == [(5, "ft_framework.config.load_config"), (7, "ft_framework.optim"),
                                              (8, ".sibling")]


# Our modules whose import IS the import of an optional heavy package (they import it at their top):
# importing one inside a function is the lazy import of that package, not a hidden cycle.
WRAPS_OPTIONAL_PACKAGE = {"ft_framework.strategies.deepspeed_adapter": "deepspeed"}


def test_the_optional_package_wrappers_import_their_package_at_the_top():
    for module, package in WRAPS_OPTIONAL_PACKAGE.items():
        tree = ast.parse((REPO / (module.replace(".", "/") + ".py")).read_text())
        # at module level, or in a module-level `with` (the adapter imports deepspeed with mlflow hidden)
        statements = [s for n in tree.body for s in ([n, *n.body] if isinstance(n, ast.With) else [n])]
        top = {a.name for n in statements if isinstance(n, ast.Import) for a in n.names}
        assert package in top, f"{module} no longer imports {package} at its top: import it at the top of its users"


# The entry module: each command imports its worker modules inside its function, so that --help, a
# usage error and a config error answer before torch loads (tests/unit/test_cli_imports.py). Nothing
# imports cli.py, so no cycle can hide there, and import-linter still checks those imports.
DEFERS_ITS_WORKERS = PACKAGE / "cli.py"


def test_no_function_local_import_of_our_own_modules():
    offenders = [f"{path.relative_to(REPO)}:{line}: {module}"
                 for path in sorted(PACKAGE.rglob("*.py")) if path != DEFERS_ITS_WORKERS
                 for line, module in function_local_imports(path.read_text())
                 if module not in WRAPS_OPTIONAL_PACKAGE]
    assert not offenders, ("imports of ft_framework modules belong at the top of the module (an import inside a "
                           "function hides a cycle; break the cycle instead):\n" + "\n".join(offenders))
