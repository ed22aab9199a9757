"""Shared by the example tests: import a script of examples/ as a module (examples/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _import_example(name: str) -> ModuleType:
    """examples/<name>.py imported under the module name example_<name>."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def load_example():
    """The example importer, as a fixture (conftest modules are not imported by name)."""
    return _import_example
