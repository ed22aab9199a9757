"""Checkpoints: one sharded layout for every strategy (layout.py; what it stores in fragments.py,
its manifest in manifest.py, its use of torch.distributed.checkpoint in dcp_io.py, whose files
dcp_read.py reads as data), export to a Hugging Face model without a training world (export.py),
and the converter of the formats before it (legacy.py)."""

from ft_framework.checkpointing.fragments import (ANCHOR, MASTER, STEP, Fragment, ParamInfo, ShardedCheckpointable, dtensor_fragments,
                        dtensor_shard_offset, param_info, whole_tensor_fragments)
from ft_framework.checkpointing.layout import load_sharded, read_fields, save_sharded
from ft_framework.checkpointing.manifest import FORMAT, MANIFEST_FILE, MODEL_SUBDIR, CheckpointFormatError, read_manifest

__all__ = ["ANCHOR", "FORMAT", "MANIFEST_FILE", "MASTER", "MODEL_SUBDIR", "STEP", "CheckpointFormatError",
           "Fragment", "ParamInfo", "ShardedCheckpointable", "dtensor_fragments", "dtensor_shard_offset", "load_sharded",
           "param_info", "read_fields", "read_manifest", "save_sharded", "whole_tensor_fragments"]
