"""Checks the trainer makes at setup, once the model and data are loaded and before the first step,
so a run that cannot finish stops before it trains rather than at its first evaluation.

    check_max_seq_length(cfg.data.max_seq_length, loaded.model, cfg.model.name_or_path)
    check_data_not_empty(data, task="sst2", source="builtin:quickstart")
"""

from __future__ import annotations

from typing import Any

from ft_framework.errors import UserError

__all__ = ["check_data_not_empty", "check_max_seq_length", "max_positions"]

# Models whose position ids start after the padding index (RoBERTa: 514 embeddings, 512 positions).
_OFFSET_POSITION_MODELS = ("roberta", "xlm-roberta", "camembert", "longformer", "bart", "mbart", "ibert")


def max_positions(model: Any) -> int | None:
    """The longest input the model's position embeddings cover, or None when it has no such limit."""
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        return None
    if getattr(config, "model_type", "") in _OFFSET_POSITION_MODELS:
        limit -= int(getattr(config, "pad_token_id", 1) or 0) + 1
    return limit


def check_max_seq_length(max_seq_length: int, model: Any, model_name: str) -> None:
    """data.max_seq_length must fit the model's position embeddings."""
    limit = max_positions(model)
    if limit is not None and max_seq_length > limit:
        raise UserError(f"data.max_seq_length: {max_seq_length} is longer than model {model_name!r} can read "
                        f"(max_position_embeddings: {limit} positions); valid: 1..{limit}")


def check_data_not_empty(data: Any, *, task: str, source: str) -> None:
    """The train split and every evaluation split must hold at least one example."""
    splits = {"train": data.train, **data.eval}
    for split, dataset in splits.items():
        if len(dataset) == 0:
            where = "the hub" if source == "hub" else repr(source)
            raise UserError(f"data: the {split} split of task {task!r} from {where} has no examples; "
                            "a run needs at least one to train on and one to evaluate")
