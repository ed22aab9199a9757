"""A model directory a user hands us is data: a config.json naming its own code (auto_map) for a model
type transformers does not ship is never run, and transformers never asks whether to run it (its
prompt calls input(); here input() records the question, and stdin is closed, as under a scheduler).
Every from_pretrained of ours passes user_files.NO_REMOTE_CODE: the model, its config and tokenizer,
the forgetting probe's reference model."""

from __future__ import annotations

import io
import json

import pytest

from ft_framework.config.schema import ModelConfig
from ft_framework.models.forgetting import EncoderForgettingProbe
from ft_framework.models.loading import load_model, load_tokenizer, sequence_classifier

CUSTOM_CONFIG = {"model_type": "planted_type", "auto_map": {
    "AutoConfig": "planted.PlantedConfig", "AutoTokenizer": ["planted.PlantedTokenizer", None],
    "AutoModel": "planted.PlantedModel", "AutoModelForSequenceClassification": "planted.PlantedClassifier",
    "AutoModelForMaskedLM": "planted.PlantedMaskedLM"}}


@pytest.fixture
def custom_model(tmp_path, monkeypatch):
    directory = tmp_path / "custom_model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(CUSTOM_CONFIG))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PlantedTokenizer", "auto_map": {"AutoTokenizer": ["planted.PlantedTokenizer", None]}}))
    (directory / "planted.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('the code ran')\n")
    asked: list[str] = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "y")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return directory, asked, tmp_path / "ran"


def _refused_unasked(load, custom_model, match: str = "trust_remote_code") -> None:
    _, asked, ran = custom_model
    with pytest.raises(ValueError, match=match):
        load()
    assert not asked, asked
    assert not ran.exists()


def test_the_model_and_its_config_are_loaded_without_its_code(custom_model):
    directory, _, _ = custom_model
    cfg = ModelConfig(name_or_path=str(directory))
    # ft-train's loading says it in one line: the code ft_framework never runs, and what to use instead
    _refused_unasked(lambda: load_model(cfg, model_class=sequence_classifier(2, False), seed=0), custom_model,
                     match=r"model\.name_or_path: .* needs its own Python code to load .* which ft_framework never runs")


def test_the_tokenizer_is_loaded_without_its_code(custom_model):
    directory, _, _ = custom_model
    _refused_unasked(lambda: load_tokenizer(str(directory)), custom_model)


def test_the_forgetting_reference_is_loaded_without_its_code(custom_model):
    """The probe's reference model (θ*'s side of the forgetting metrics): its masked-LM class, and the
    base model it falls back to."""
    from transformers import AutoModel, AutoModelForMaskedLM

    directory, _, _ = custom_model
    load = EncoderForgettingProbe._load_reference_from  # the loading step alone (the probe's text and batches aside)
    _refused_unasked(lambda: load(None, str(directory), True, AutoModel, AutoModelForMaskedLM), custom_model)
