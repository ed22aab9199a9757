"""The trainer with strategy.offload_optimizer: overlapped and serial runs end at the same weights
(within 1e-6, relative) with clipping firing, and metrics.jsonl counts the rollbacks."""

import json

import pytest
import torch

from tiny_run import write_run_config
from ft_framework.config import load_config
from ft_framework.trainer import Trainer


def _close(actual, expected, what, rel=1e-6):
    scale = expected.abs().max().clamp_min(1e-30).double()
    err = (actual.double() - expected.double()).abs()
    assert bool((err <= rel * (expected.double().abs() + scale)).all()), f"{what}: max error {float(err.max())}"


def _serial_and_overlapped(tiny_bert_dir, tmp_path, label: str, training: dict, **sections):
    """The same run with the serial and the overlapped offload: {overlap: (trainer, its train
    records from metrics.jsonl)}."""
    runs = {}
    for overlap in (False, True):
        out = tmp_path / f"{label}{overlap}"
        cfg = write_run_config(tmp_path / f"{label}{overlap}.yaml", tiny_bert_dir, out, training=training,
                               evaluation={"num_evals": 1, "batch_size": 16},
                               strategy={"name": "single", "offload_optimizer": {"overlap": overlap}}, **sections)
        trainer = Trainer(load_config(cfg))
        trainer.fit()
        trainer.strategy.close()
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[overlap] = (trainer, [r for r in records if r["type"] == "train"])
    return runs


@pytest.mark.slow
def test_trainer_runs_overlapped_offload_and_logs_rollbacks(tiny_bert_dir, tmp_path):
    results = _serial_and_overlapped(tiny_bert_dir, tmp_path, "fp32", {"max_steps": 5, "max_grad_norm": 0.255})
    (serial, serial_log), (overlap, overlap_log) = results[False], results[True]
    clips = [r["grad_norm"] > 0.255 for r in serial_log]
    # Up to the first step that clips, both paths took the same steps on the same gradients: the
    # same norms, bit for bit. A rolled-back step is exact to a few ulp (docs/offload.md), so the
    # weights after it, and the norms they give, agree within 1e-6 relative.
    first_clip = clips.index(True)
    overlap_norms, serial_norms = [r["grad_norm"] for r in overlap_log], [r["grad_norm"] for r in serial_log]
    assert overlap_norms[:first_clip + 1] == serial_norms[:first_clip + 1]
    assert overlap_norms == pytest.approx(serial_norms, rel=1e-6, abs=0)
    # A step speculates unless the one before clipped; a speculated step that clips rolls back.
    expected = sum(c and (i == 0 or not clips[i - 1]) for i, c in enumerate(clips))
    assert expected > 0 and overlap_log[-1]["offload_rollbacks"] == expected
    assert serial_log[-1]["offload_rollbacks"] == 0
    compared = 0
    for (name, p), q in zip(overlap.model.named_parameters(), serial.model.parameters()):
        # BERT's attention key bias has an exactly zero gradient (softmax ignores a constant
        # shift): it holds rounding noise of 1e-13, which no relative comparison can judge.
        if q.detach().abs().max() > 1e-8:
            _close(p.detach(), q.detach(), name)
            compared += 1
    assert compared > 30


@pytest.mark.slow
def test_overlapped_offload_resumes_from_its_checkpoint(tiny_bert_dir, tmp_path):
    """Checkpoints hold the host masters and their state: a run cut at step 3 and resumed ends
    where the uninterrupted overlapped run ends (within 1e-6, relative)."""
    runs = {}
    for label, cut in (("full", None), ("cut", 3)):
        cfg = write_run_config(tmp_path / f"{label}.yaml", tiny_bert_dir, tmp_path / label,
                               training={"max_steps": 5, "max_grad_norm": 0.255}, checkpoint={"every_steps": 3},
                               evaluation={"num_evals": 1, "batch_size": 16},
                               strategy={"name": "single", "offload_optimizer": {"overlap": True}})
        if cut:
            first = Trainer(load_config(cfg))
            assert first.fit(stop_after_step=cut) == {"stopped_at_step": cut}
            first.strategy.close()
            trainer = Trainer(load_config(cfg, ["checkpoint.resume_from=latest"]))
        else:
            trainer = Trainer(load_config(cfg))
        trainer.fit()
        trainer.strategy.close()
        runs[label] = trainer
    assert runs["cut"].state.step == runs["full"].state.step == 5
    for (name, p), q in zip(runs["cut"].model.named_parameters(), runs["full"].model.parameters()):
        if q.detach().abs().max() > 1e-8:  # see above: the attention key bias is rounding noise
            _close(p.detach(), q.detach(), name)


@pytest.mark.slow
def test_trainer_runs_the_device_lean_offload_in_bf16(tiny_bert_dir, tmp_path):
    """training.precision bf16: the trainer's model is bf16 (no autocast), evaluation and the
    checkpoint run on it, and serial and overlapped end with the fp32 masters within 1e-6
    (relative), the bf16 weights within one bf16 ulp, after clipping fired and was rolled back."""
    runs = _serial_and_overlapped(tiny_bert_dir, tmp_path, "bf16",
                                  {"max_steps": 4, "max_grad_norm": 0.255, "precision": "bf16"},
                                  checkpoint={"every_steps": 4})
    (serial, serial_log), (overlap, overlap_log) = runs[False], runs[True]
    assert {p.dtype for p in overlap.model.parameters()} == {torch.bfloat16}
    assert serial.strategy.autocast().__class__.__name__ == "nullcontext"
    assert overlap_log[-1]["offload_rollbacks"] > 0
    for (name, p), q in zip(overlap.model.named_parameters(), serial.model.parameters()):
        # Masters a few ulp (fp32) apart after a rollback may round to neighbouring bf16 values.
        assert bool(((p.float() - q.float()).abs() <= q.float().abs() * 2**-7).all()), name
    for (name, m), (_, r) in zip(overlap.strategy._named_masters(), serial.strategy._named_masters()):
        if r.abs().max() > 1e-8:  # see above: the attention key bias is rounding noise
            _close(m.detach(), r.detach(), name)
