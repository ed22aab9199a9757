"""models/hub.py: where a model comes from. A cache that cannot be read is not "not cached"."""

from __future__ import annotations

import pytest
from huggingface_hub import constants

from ft_framework.errors import UserError
from ft_framework.models import hub


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never the network: the answer comes from the cache alone
    return tmp_path


def _cached_model(cache, repo_id: str, commit: str = "0" * 40):
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    return repo


def test_a_cached_model_is_loaded_from_the_cache(cache):
    _cached_model(cache, "org/model")
    assert hub.check_model_source("org/model") is True


def test_a_model_not_in_the_cache_is_reported_as_not_cached(cache):
    with pytest.raises(UserError, match="neither a local directory nor in the Hugging Face cache"):
        hub.check_model_source("org/other")


def test_a_name_the_hub_rejects_is_not_cached(cache):
    assert hub._in_cache("org/has spaces!", "model.name_or_path") is False


def test_a_cache_that_cannot_be_read_is_its_own_error(cache):
    repo = _cached_model(cache, "org/model")
    snapshots = repo / "snapshots"
    for path in sorted(snapshots.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    snapshots.rmdir()
    snapshots.write_text("not a directory")  # listing the snapshots fails with an OSError
    with pytest.raises(UserError) as info:
        hub.check_model_source("org/model", key="model.tokenizer")
    message = str(info.value)
    assert message.startswith("model.tokenizer: the Hugging Face cache")
    assert "cannot be read for 'org/model'" in message and "NotADirectoryError" in message
    assert "neither a local directory nor" not in message
