"""Re-initialization draws the same values in every process: the modules it re-initializes take
their random draws in the model's order, never in a set's, whose order of strings changes with
PYTHONHASHSEED from one process to the next (model.init: random, model.reinit_top_layers)."""

from __future__ import annotations

import os
import subprocess
import sys

PROGRAM = """
import hashlib, torch
from transformers import BertConfig, BertModel
from ft_framework.models.loading import reinitialize_parameters
torch.manual_seed(0)
model = BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=24, max_position_embeddings=32))
names = [n for n, _ in model.named_parameters()]
torch.manual_seed(1)
reinitialize_parameters(model, names)
digest = hashlib.sha256()
for name, param in model.named_parameters():
    digest.update(name.encode()); digest.update(param.detach().numpy().tobytes())
print(digest.hexdigest())
"""


def test_reinitialized_weights_do_not_depend_on_the_processes_hash_seed():
    digests = set()
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        assert out.returncode == 0, out.stderr[-3000:]
        digests.add(out.stdout.strip())
    assert len(digests) == 1
