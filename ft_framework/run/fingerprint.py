"""The training-relevant fingerprint of a run's config, and the check a resume makes against it.

Every checkpoint stores the resolved config it was trained with (and the world size). A resume
compares the config it is started with against that one, key by key:

- keys that may change on resume (:data:`ALLOWED_ON_RESUME`) pass, and so do the keys the user names
  in ``checkpoint.allow_config_change``;
- every other difference refuses the resume with one line listing each key with its old and new
  value.

Every change that passes is returned, stamped with the step it takes effect at, so results.json
can record when the run stopped being one config.

The record also holds the content id of every data file and Hub data set the run reads, under the
config key that names it (the task kind's ``data_content``: the token cache's key of a file's bytes,
a Hub data set's revision). A resume compares those too, once the data is read
(:func:`check_data_content`): a file whose content changed refuses the resume as a changed key does,
naming the key, the file and both short ids.

    changes = check_resume(saved_record, current_record, step=120, allowed_by_user=["optimizer.hparams.lr"])
    content, changes = check_data_content(saved_record, {"data.files.train": "9f2c..."}, config, step=120)
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, Callable, Iterable, Mapping

from ft_framework.dotted import flatten_dotted
from ft_framework.errors import UserError, did_you_mean, quoted, shortened

__all__ = ["ALLOWED_ON_RESUME", "DATA_CONTENT", "ResumeRefused", "check_allow_list", "check_data_content",
           "check_resume", "config_record", "diff_configs", "fingerprint"]

logger = logging.getLogger(__name__)

# The record's entry of the data's content ids ({config key: content id}); a record without it was
# written before they were recorded.
DATA_CONTENT = "data_content"
# How many hex digits of a content id a message shows.
_SHORT_ID = 12

# Dotted key (or key prefix: a whole section) -> why it may change when a run resumes. Written here
# once; the README and the refusal message point at this list.
ALLOWED_ON_RESUME: dict[str, str] = {
    "logging": "where and how often the run logs (includes the progress bar and output_dir)",
    "evaluation.batch_size": "evaluation batch size (same predictions, other memory use)",
    "evaluation.forgetting": "what forgetting is measured on (measuring changes no weight)",
    "evaluation.benchmarks": "how the benchmarks are scored (scoring changes no weight; θ*'s kept scores must be of "
                             "the same tasks)",
    "evaluation.interpolation": "the interpolation toward θ* at the run's end (it evaluates the finished model)",
    "checkpoint.every_steps": "checkpoint cadence",
    "checkpoint.keep_last": "checkpoint cadence",
    "checkpoint.resume_from": "where to resume from",
    "checkpoint.allow_config_change": "this list itself",
    "checkpoint.export_dir": "where the final model is exported",
    "checkpoint.on_signal": "what a preemption signal does (save or exit)",
    "training.max_steps": "a longer run (only longer: a shorter one would cut the schedule it ran)",
    "training.num_epochs": "a longer run (only longer)",
    "strategy": "strategy and world size (checkpoints reshard)",
    "training.device": "the device (like the strategy: where it runs, not what it trains)",
    "training.activation_checkpointing": "memory for time: activations recomputed, same gradients",
    "training.chunked_loss": "memory for time: a decoder's loss a chunk of label tokens at a time, same values",
    "model.attn_implementation": "the attention kernel: the same attention, computed another way",
    "world_size": "number of processes (checkpoints reshard)",
    # The split of the global batch over ranks and accumulation steps follows the world size; the
    # global batch itself (training.global_batch_size below) must not change.
    "training.per_device_batch_size": "the split of the global batch over ranks",
    "training.gradient_accumulation_steps": "the split of the global batch over ranks",
}
# Allowed only when the new value is at least the old one.
_ONLY_LONGER = ("training.max_steps", "training.num_epochs")
# Synthetic keys added to the compared record (not config keys).
_DERIVED = ("world_size", "training.global_batch_size")


class ResumeRefused(UserError):
    """The config of a resumed run differs from its checkpoint's in a training-relevant key, or the
    content of a data file it reads from what the checkpoint trained on."""


def config_record(config: Mapping[str, Any], world_size: int,
                  data_content: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What a checkpoint stores about its config: the resolved config, the world size, the global
    batch, the fingerprint (a hash of the training-relevant part) and the content ids of the data
    the run read (`data_content`: {config key: content id}, the task kind's)."""
    training = config.get("training") or {}
    record = {
        "config": json.loads(json.dumps(config)),
        "world_size": int(world_size),
        "global_batch_size": _global_batch(training, world_size),
    }
    record["fingerprint"] = fingerprint(record)
    record[DATA_CONTENT] = dict(data_content or {})
    return record


def _global_batch(training: Mapping[str, Any], world_size: int) -> int | None:
    try:
        return int(training["per_device_batch_size"]) * int(training["gradient_accumulation_steps"]) * int(world_size)
    except (KeyError, TypeError, ValueError):
        return None


def _flat(record: Mapping[str, Any]) -> dict[str, Any]:
    """The compared view of a record: dotted config keys plus the derived keys."""
    out = flatten_dotted(record.get("config") or {})
    out["world_size"] = record.get("world_size")
    out["training.global_batch_size"] = record.get("global_batch_size")
    return out


def _matches(key: str, patterns: Iterable[str]) -> str | None:
    """The first pattern that is `key` or a section above it."""
    for pattern in patterns:
        if key == pattern or key.startswith(pattern + "."):
            return pattern
    return None


def fingerprint(record: Mapping[str, Any]) -> str:
    """sha256 (16 hex digits) of the keys that may not change on resume."""
    relevant = {k: v for k, v in sorted(_flat(record).items()) if not _matches(k, ALLOWED_ON_RESUME)}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()[:16]


# default_of(dotted key) -> (whether the schema declares the key, its default): a key a checkpoint's
# record lacks because it was added to the schema after that checkpoint was written, and that is
# still at its default, is no change.
DefaultOf = Callable[[str], "tuple[bool, Any]"]


def diff_configs(old: Mapping[str, Any], new: Mapping[str, Any], *,
                 default_of: DefaultOf | None = None) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every key whose value differs, in key order."""
    a, b = _flat(old), _flat(new)
    missing = object()
    old_sections = {k.rsplit(".", i)[0] for k in a for i in range(1, k.count(".") + 1)}
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, missing), b.get(key, missing)
        if va is missing and default_of is not None and _added_at_default(key, vb, old_sections, default_of):
            continue
        if va != vb:
            out.append((key, None if va is missing else va, None if vb is missing else vb))
    return out


def _added_at_default(key: str, value: Any, old_sections: set[str], default_of: DefaultOf) -> bool:
    """Whether `key`, which the old record lacks, was added to the schema since and holds its default.
    Its keys do not make an optional section (default None) that the old record lacks "at default":
    the old run had it off, so turning it on is a change."""
    parts = key.split(".")
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i])
        if prefix not in old_sections and default_of(prefix) == (True, None):
            return False
    return default_of(key) == (True, value)


def _longer(old: Any, new: Any) -> bool:
    return old is not None and new is not None and new >= old


def check_allow_list(keys: Iterable[str], config: Mapping[str, Any]) -> None:
    """Every entry of checkpoint.allow_config_change must name a config key or section."""
    flat = flatten_dotted(config)
    sections = {k.rsplit(".", i)[0] for k in flat for i in range(k.count(".") + 1)}
    for key in keys:
        if key not in sections and key not in _DERIVED:
            raise UserError(f"checkpoint.allow_config_change: {quoted(key)} is not a config key"
                            f"{did_you_mean(key, sorted(sections))}; give dotted keys such as "
                            "optimizer.hparams.lr or a whole section such as optimizer")


def _show(value: Any) -> str:
    return "unset" if value is None else shortened(json.dumps(value, default=str))


def check_resume(saved: Mapping[str, Any], current: Mapping[str, Any], *, step: int,
                 allowed_by_user: Iterable[str] = (), where: str = "the checkpoint",
                 default_of: DefaultOf | None = None) -> list[dict[str, Any]]:
    """Compares the config a run resumes with (`current`, from :func:`config_record`) against its
    checkpoint's (`saved`). Raises :class:`ResumeRefused` listing every key that may not change;
    returns the changes that may, as ``{"step", "key", "old", "new", "allowed_by"}`` records.
    `default_of` (the schema's defaults) lets a key added since the checkpoint pass at its default."""
    user = list(allowed_by_user)
    changes, refused = [], []
    for key, old, new in diff_configs(saved, current, default_of=default_of):
        if _matches(key, user):
            allowed_by = "checkpoint.allow_config_change"
        elif _matches(key, ALLOWED_ON_RESUME) and (key not in _ONLY_LONGER or _longer(old, new)):
            allowed_by = "allowed on resume"
        else:
            refused.append((key, old, new))
            continue
        changes.append({"step": int(step), "key": key, "old": old, "new": new, "allowed_by": allowed_by})
    if refused:
        listed = "; ".join(f"{k}: {_show(o)} -> {_show(n)}" for k, o, n in refused)
        shorter = [k for k, o, n in refused if k in _ONLY_LONGER and o is not None and n is not None]
        hint = " (a resumed run may only get longer)" if shorter else ""
        raise ResumeRefused(
            f"cannot resume from {where} (step {step}): its config differs in {listed}{hint}. Resume with "
            "the checkpoint's values, start a fresh run in another logging.output_dir, or allow these keys "
            f"with checkpoint.allow_config_change=[{','.join(k for k, _, _ in refused)}]")
    return changes


def check_data_content(saved: Mapping[str, Any] | None, current: Mapping[str, str], config: Mapping[str, Any], *,
                       step: int, allowed_by_user: Iterable[str] = (),
                       where: str = "the checkpoint") -> tuple[dict[str, str], list[dict[str, Any]]]:
    """Compares the content ids of the data a resumed run read (`current`: {config key: content id},
    the task kind's) against those its checkpoint's record (`saved`) holds, `config` being the
    resolved config the run resumes with. A key whose content differs passes when the user allows it
    (checkpoint.allow_config_change) or the key may change on resume (ALLOWED_ON_RESUME: the
    forgetting probe's file); any other refuses the resume in one line naming each key, its file and
    both short ids. Returns the ids the run records from now on and the changes that passed (as
    :func:`check_resume`'s, with ``"content": True``).

    A key the checkpoint holds and this run did not read (a file read once, before the first step,
    as optimizer.importance's) keeps the checkpoint's id while the config names the same file. A
    record without content ids (a checkpoint written before they were recorded) is not compared: one
    warning says so."""
    if saved is None or DATA_CONTENT not in saved:
        logger.warning("checkpoint %s records no content ids of its data files (written before they were recorded): "
                       "the data this run reads could not be checked against the data it trained on", where)
        return dict(current), []
    old_ids = dict(saved[DATA_CONTENT])
    new_config, old_config = flatten_dotted(config), flatten_dotted(saved.get("config") or {})
    kept = {key: content for key, content in old_ids.items()
            if key not in current and key in new_config and new_config[key] == old_config.get(key)}
    user = list(allowed_by_user)
    changes, refused = [], []
    for key in sorted(set(old_ids) & set(current)):
        old, new = old_ids[key], current[key]
        if old == new:
            continue
        if _matches(key, user):
            allowed_by = "checkpoint.allow_config_change"
        elif _matches(key, ALLOWED_ON_RESUME):
            allowed_by = "allowed on resume"
        else:
            refused.append((key, old, new))
            continue
        changes.append({"step": int(step), "key": key, "old": old, "new": new, "allowed_by": allowed_by,
                        "content": True})
    if refused:
        listed = "; ".join(f"{key} ({shortened(str(new_config.get(key)))}): {old[:_SHORT_ID]} -> {new[:_SHORT_ID]}"
                           for key, old, new in refused)
        raise ResumeRefused(
            f"cannot resume from {where} (step {step}): the content of its data differs in {listed}. Resume with the "
            "data it trained on, start a fresh run in another logging.output_dir, or accept the new data with "
            f"checkpoint.allow_config_change=[{','.join(key for key, _, _ in refused)}]")
    return {**kept, **current}, changes
