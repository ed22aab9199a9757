"""loss.kl_to_pretrained on 2 CPU ranks (gloo) equals one process: each rank runs its share of the pass
at θ* through the strategy's forward (DDP's replicated model, FSDP2's sharded one, DeepSpeed ZeRO-3's
partitioned one, its head gathered by its hooks), the main rank
writes the token cache entry, and every rank's items carry their own targets; the training losses,
the logged KL, the gradient norms and the stored arrays equal the single-process run's. One launch
runs the 2-rank runs, each with a token cache of its own (so that each makes its pass)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from rank_launcher import FIT_WORKER, fit_step, launch
from tiny_llm import build_tiny_llm_dir, write_sft_rows, write_sft_run_config

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow
TWO_RANK = {"ddp": {"name": "ddp"}, "fsdp": {"name": "fsdp"},
            "zero3": {"name": "deepspeed", "deepspeed": {"zero_stage": 3}}}
SECTIONS = dict(loss={"kl_to_pretrained": 0.5, "kl_top_k": 6}, data={"packing": True},
                evaluation={"num_evals": 1, "generation": {"samples": 0}, "forgetting": {"enabled": False}})


def records(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from ft_framework.config import load_config
    from ft_framework.trainer import Trainer

    root = tmp_path_factory.mktemp("kl_anchor_ranks")
    files = write_sft_rows(root / "data", train_rows=30)
    model = build_tiny_llm_dir(root / "llama", "llama")
    one = write_sft_run_config(root / "one.yaml", model, root / "one" / "run", files,
                               training={"max_steps": 3, "per_device_batch_size": 4}, **SECTIONS)
    trainer = Trainer(load_config(one))
    trainer.fit()
    trainer.strategy.close()
    configs = [write_sft_run_config(root / f"{name}.yaml", model, root / name / "run", files, strategy=strategy,
                                    training={"max_steps": 3, "per_device_batch_size": 2}, **SECTIONS)
               for name, strategy in TWO_RANK.items()]
    launch(FIT_WORKER, [fit_step(c) for c in configs], root)
    return root


@pytest.mark.parametrize("strategy", list(TWO_RANK))
def test_two_ranks_equal_one_process(runs, strategy):
    want_dir, got_dir = runs / "one" / "run", runs / strategy / "run"
    want, got = records(want_dir), records(got_dir)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    assert abs(got[0]["kl_to_pretrained"]) < 1e-6  # at θ*: every item met its own targets
    for key in ("loss", "kl_to_pretrained", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-5, abs=1e-7), key
    a, b = (json.loads((d / "results.json").read_text())["kl_to_pretrained"] for d in (want_dir, got_dir))
    assert b["reused"] is False and (b["tokens"], b["cache_bytes"], b["k"]) == (a["tokens"], a["cache_bytes"], a["k"])
    for name in ("offsets", "ids"):  # the same rows in the same order: the main rank wrote every rank's share
        assert np.array_equal(np.fromfile(Path(b["entry"]) / name, dtype=np.int64 if name == "offsets" else np.int32),
                              np.fromfile(Path(a["entry"]) / name, dtype=np.int64 if name == "offsets" else np.int32))
    np.testing.assert_allclose(np.fromfile(Path(b["entry"]) / "logp", dtype=np.float32),
                               np.fromfile(Path(a["entry"]) / "logp", dtype=np.float32), rtol=1e-5, atol=1e-6)
