"""LoRA runs through the real trainer on the tiny BERT: one process (export merged + adapter), and
2-rank FSDP2 on CPU (gloo) against the one-process run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from tiny_run import write_run_config  # noqa: E402
from ft_framework.config import load_config  # noqa: E402
from ft_framework.trainer import Trainer  # noqa: E402
from ft_framework.distributed.rendezvous import free_port

REPO = Path(__file__).resolve().parents[2]


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def test_lora_run_end_to_end_exports_merged_model_and_adapter(tiny_bert_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    export = tmp_path / "export"
    cfg = write_run_config(tmp_path / "run.yaml", tiny_bert_dir, tmp_path / "out", training={"max_steps": 6},
                           model={"lora": {"r": 4, "alpha": 8}}, optimizer={"name": "recadam", "hparams": {"lr": 5e-3}},
                           checkpoint={"export_dir": str(export)})
    trainer = Trainer(load_config(cfg))
    results = trainer.fit()
    records = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    distances = [r["forgetting_distance"] for r in records if r["type"] == "train"]
    assert len(distances) == 6 and all(d > 0 for d in distances)
    # The export is the merged model: plain transformers loads it, and its distance from θ* (the
    # pretrained encoder) is the last logged one.
    merged = AutoModelForSequenceClassification.from_pretrained(export)
    pretrained = AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir)
    sd, ref = merged.state_dict(), pretrained.state_dict()
    dist = sum(float((sd[n].double() - ref[n].double()).square().sum()) for n in ref if not n.startswith("classifier."))
    assert dist ** 0.5 == pytest.approx(distances[-1], rel=1e-6)
    changed = {n.rsplit(".", 1)[0] for n in ref if not n.startswith("classifier.") and not torch.equal(sd[n], ref[n])}
    assert changed and all(n.endswith(("query", "value")) for n in changed)
    # The adapter alone loads with peft onto the pretrained model and gives the same predictions.
    from peft import PeftModel

    assert (export / "adapter" / "adapter_config.json").is_file()
    base = AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir)
    with_adapter = PeftModel.from_pretrained(base, export / "adapter").eval()
    merged.eval()
    x = torch.randint(0, 1000, (3, 9))
    torch.testing.assert_close(with_adapter(input_ids=x).logits, merged(input_ids=x).logits, rtol=1e-5, atol=1e-6)
    assert results["exported_to"] == str(export)


@pytest.mark.slow
def test_lora_under_two_rank_fsdp2_equals_one_process(tiny_bert_dir, tmp_path):
    common = dict(model={"lora": {"r": 4, "alpha": 8}}, optimizer={"name": "recadam", "hparams": {"lr": 5e-3}},
                  evaluation={"num_evals": 1})
    single_cfg = write_run_config(tmp_path / "single.yaml", tiny_bert_dir, tmp_path / "single",
                                  training={"max_steps": 4, "per_device_batch_size": 8},
                                  checkpoint={"export_dir": str(tmp_path / "single" / "export")}, **common)
    Trainer(load_config(single_cfg)).fit()
    fsdp_cfg = write_run_config(tmp_path / "fsdp.yaml", tiny_bert_dir, tmp_path / "fsdp",
                                training={"max_steps": 4, "per_device_batch_size": 4}, strategy={"name": "fsdp"},
                                checkpoint={"export_dir": str(tmp_path / "fsdp" / "export")}, **common)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", str(free_port()), str(REPO / "launch" / "train.py"), "--config",
                          str(fsdp_cfg)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    train = lambda d: [r for r in read_jsonl(tmp_path / d / "metrics.jsonl") if r["type"] == "train"]
    a, b = train("single"), train("fsdp")
    assert len(a) == len(b) == 4
    # The merged weights' distance from θ*, gathered from the sharded adapters, agrees with one process.
    assert [r["forgetting_distance"] for r in b] == pytest.approx([r["forgetting_distance"] for r in a], rel=1e-4)
    from transformers import AutoModelForSequenceClassification

    merged_a = AutoModelForSequenceClassification.from_pretrained(tmp_path / "single" / "export").state_dict()
    merged_b = AutoModelForSequenceClassification.from_pretrained(tmp_path / "fsdp" / "export").state_dict()
    for name in merged_a:
        torch.testing.assert_close(merged_b[name], merged_a[name], rtol=0, atol=1e-5, msg=name)
    assert (tmp_path / "fsdp" / "export" / "adapter" / "adapter_model.safetensors").is_file()
