"""Checkpoints: one sharded layout for every strategy (layout.py), export to a Hugging Face model
without a training world (export.py), and the converter of the formats before it (legacy.py)."""

from .layout import (ANCHOR, FORMAT, MANIFEST_FILE, MASTER, MODEL_SUBDIR, STEP, CheckpointFormatError, Fragment,
                     ParamInfo, ShardedCheckpointable, dtensor_fragments, load_sharded, param_info, read_fields, read_manifest,
                     save_sharded, whole_tensor_fragments)

__all__ = ["ANCHOR", "FORMAT", "MANIFEST_FILE", "MASTER", "MODEL_SUBDIR", "STEP", "CheckpointFormatError",
           "Fragment", "ParamInfo", "ShardedCheckpointable", "dtensor_fragments", "load_sharded", "param_info",
           "read_fields", "read_manifest", "save_sharded", "whole_tensor_fragments"]
