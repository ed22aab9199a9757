"""A Hub data set in a Hugging Face cache, made without the network, as `load_dataset("org/name")`
leaves it after a download: datasets' own JSON builder prepares the rows into Arrow files under
HF_DATASETS_CACHE, in the directory a Hub download of the repository's default configuration uses
(``org___name/default/0.0.0/<revision>``). Offline (HF_HUB_OFFLINE=1), `load_dataset("org/name")`
and `load_dataset_builder` then find it there, as they find a real download."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

__all__ = ["REVISION", "cache_hub_dataset", "offline_env"]

REVISION = "0123456789abcdef0123456789abcdef01234567"


def cache_hub_dataset(hf_home: Path, repo_id: str, splits: dict[str, list[dict]], revision: str = REVISION) -> Path:
    """Writes the rows of each split of `repo_id` into the datasets cache of `hf_home` (its
    ``datasets`` folder, where HF_HOME=hf_home puts HF_DATASETS_CACHE); the prepared directory."""
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.json.json import Json

    org, name = repo_id.split("/")
    cache = Path(hf_home) / "datasets"
    source = Path(hf_home) / "source" / name
    source.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, rows in splits.items():
        path = source / f"{split}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        files[split] = [str(path)]
    builder = Json(cache_dir=str(cache), dataset_name=name, config_name="default", hash=revision,
                   data_files=DataFilesDict.from_patterns(files))
    builder.download_and_prepare()
    # A Hub download's directory: the repository's namespace in its name, the configuration as named.
    target = cache / f"{org}___{name}" / "default" / "0.0.0" / revision
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(builder.cache_dir, target)
    shutil.rmtree(source.parent)
    return target


def offline_env(env: dict, hf_home: Path) -> dict:
    """`env` with HF_HOME at `hf_home` and the Hub offline."""
    env = {key: value for key, value in env.items() if not key.startswith(("HF_", "HUGGINGFACE_"))}
    return {**env, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
