"""Every rank trains the same config, checked once at start.

Each node of a multi-node job reads its own copy of the config file and its own command-line
overrides. A node started with an older file, or with an override the others lack, would otherwise
train something else in lock-step with them (or hang in a collective of another shape). At start each
rank hashes its resolved config; the hashes are all-gathered, and when they differ every rank raises
the same one-line :class:`ConfigDisagreement` naming the ranks and the keys that differ.

    check_config_agreement(cfg.to_dict())   # a no-op without a process group
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

from ft_framework.distributed import collectives
from ft_framework.dotted import flatten_dotted
from ft_framework.errors import UserError

__all__ = ["ConfigDisagreement", "check_config_agreement", "config_hash"]

# Keys listed in the message at most (the hash covers all of them).
_MAX_KEYS_SHOWN = 5


class ConfigDisagreement(UserError):
    """The ranks of one job were started with different resolved configs."""


def config_hash(config: Mapping[str, Any]) -> str:
    """sha256 (12 hex digits) of the resolved config, independent of key order."""
    text = json.dumps(config, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in ranks)


def describe_disagreement(configs: list[Mapping[str, Any]]) -> str | None:
    """The one-line message for the configs of ranks 0..n-1, or None when they agree."""
    hashes = [config_hash(c) for c in configs]
    if len(set(hashes)) == 1:
        return None
    groups: dict[str, list[int]] = {}
    for rank, h in enumerate(hashes):
        groups.setdefault(h, []).append(rank)
    reference = flatten_dotted(configs[0])
    missing = object()

    def show(value: Any) -> str:
        return "unset" if value is missing else json.dumps(value, default=str)

    diffs: dict[str, list[str]] = {}
    for h, ranks in groups.items():
        if h == hashes[0]:
            continue
        other = flatten_dotted(configs[ranks[0]])
        for key in sorted(set(reference) | set(other)):
            a, b = reference.get(key, missing), other.get(key, missing)
            if a != b:
                diffs.setdefault(key, []).append(f"{show(b)} on {_ranks(ranks)}")
    listed = [f"{key} is {show(reference.get(key, missing))} on rank 0 but " + ", ".join(where)
              for key, where in sorted(diffs.items())[:_MAX_KEYS_SHOWN]]
    more = f" (and {len(diffs) - _MAX_KEYS_SHOWN} more keys)" if len(diffs) > _MAX_KEYS_SHOWN else ""
    hashes_text = "; ".join(f"{_ranks(r)}: {h}" for h, r in groups.items())
    return (f"the ranks disagree about the config (hash of the resolved config: {hashes_text}): "
            f"{'; '.join(listed)}{more}. Start every node with the same config file and the same overrides")


def check_config_agreement(config: Mapping[str, Any]) -> str:
    """All-gathers the hash of `config` (the resolved config as plain data) over the world and
    raises :class:`ConfigDisagreement` on every rank when any differs. Returns this rank's hash.

    The hashes agree or disagree identically on every rank, so every rank takes the same branch:
    on disagreement the configs themselves are gathered (a second collective) to name the keys."""
    mine = config_hash(config)
    if not collectives.is_distributed():
        return mine
    hashes = collectives.all_gather_object(mine)
    if len(set(hashes)) == 1:
        return mine
    configs = collectives.all_gather_object(json.loads(json.dumps(config, default=str)))
    raise ConfigDisagreement(describe_disagreement(configs))
