"""DeepSpeed ZeRO-1/2/3 (with and without CPU offload) on 2 CPU ranks (gloo, DS_ACCELERATOR=cpu)
against the single-process run of the same optimizer on the same data.

The worker (tests/distributed/ds_worker.py) runs every case in three steps of forked ranks (2
ranks, then 1 rank loading the 2-rank checkpoint, then 2 ranks loading the 1-rank one) from one
process (rank_launcher.py); this module launches it once and compares. Tolerance vs single process: 1e-6 absolute on parameters of scale
~0.1 after 5 steps — the only difference is the order of the gradient reduction (observed 7e-9).
"""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from ds_common import (ACCUM_CASES, CASES, CHECKPOINTING_CASES, HPARAMS, LR, global_batch,  # noqa: E402
                       make_model_and_anchors)
from rank_launcher import launch, step  # noqa: E402

from ft_framework.checkpointing import read_fields  # noqa: E402
from ft_framework.optim import build_optimizer  # noqa: E402
from ft_framework.optim.groups import build_param_groups  # noqa: E402

pytestmark = pytest.mark.slow
PARAM_ATOL = 1e-6


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepspeed")
    launch(HERE / "ds_worker.py", [step("main", 2, out=path),
                                   step("reshard", 1, out=path, load_from="ckpt", save_to="ckpt1rank"),
                                   step("reshard", 2, out=path, load_from="ckpt1rank", save_to=None)],
           path, timeout=600)
    return path


@pytest.fixture(scope="module")
def reference():
    """The same 5 steps in one process without DeepSpeed, and the anchors (theta*)."""
    model, anchors = make_model_and_anchors()
    opt = build_optimizer("recadam", build_param_groups(model, anchors, lr=LR, weight_decay=0.01),
                          **HPARAMS)
    for step in range(5):
        model(**global_batch(step)).loss.backward()
        opt.step()
        opt.zero_grad()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "anchors": anchors, "forgetting_distance": opt.forgetting_distance()}


def load(results, name):
    return torch.load(results / name, weights_only=True)


def assert_params_match(got: dict, want: dict, atol=PARAM_ATOL):
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("case", CASES + ACCUM_CASES)
def test_parameters_equal_single_process(results, reference, case):
    assert_params_match(load(results, f"{case}.pt")["masters"], reference["params"])


@pytest.mark.parametrize("case", CHECKPOINTING_CASES)
def test_activation_checkpointing_gives_the_same_weights_bit_for_bit(results, case):
    """ZeRO-3 gathers each module's parameters again in the recomputation; dropout and Mixout
    draw the same masks there."""
    plain, checkpointed = (load(results, f"checkpointing_{case}_{tag}.pt") for tag in ("plain", "checkpointed"))
    assert plain["blocks"] == 0 and checkpointed["blocks"] == 1  # ALBERT's one shared layer group
    # 3 steps x 2 layers: the shared layer's feed-forward ran again in each layer's recomputation.
    assert plain["inner_calls"] == 6 and checkpointed["inner_calls"] == 12
    assert set(checkpointed["masters"]) == set(plain["masters"])
    for name, value in plain["masters"].items():
        assert torch.equal(checkpointed["masters"][name], value), name


@pytest.mark.parametrize("case", CASES)
def test_anchors_are_exact_and_sharded(results, reference, case):
    got = load(results, f"{case}.pt")
    assert set(got["anchors"]) == set(reference["anchors"])  # the head has none
    for name, anchor in reference["anchors"].items():
        assert torch.equal(got["anchors"][name], anchor), name
    total = sum(a.numel() for a in reference["anchors"].values())
    per_rank = got["anchor_numel_per_rank"]
    assert len(per_rank) == 2
    # ~total/2 each; ZeRO pads partitions to alignment, a few elements at most here.
    assert all(total / 2 <= n <= total / 2 + 64 for n in per_rank), (per_rank, total)


@pytest.mark.parametrize("case", CASES + ACCUM_CASES)
def test_the_step_runs_where_the_partitions_live_and_telemetry_is_global(results, reference, case):
    got = load(results, f"{case}.pt")
    # Under offload the fp32 partitions are CPU tensors whatever the accelerator, and the C++
    # kernel steps them on every rank. Without offload they live on the accelerator's device (the
    # CPU here, under DS_ACCELERATOR=cpu, so the kernel runs there too; on a GPU it is torch).
    where = "cpu" if "offload" in case else got["accelerator"]
    assert got["partition_devices"] == [where]
    kernel = where == "cpu"
    assert got["impl"] == ("cpu" if kernel else "torch")
    assert len(got["kernel_calls"]) == 2
    assert all((n > 0) == kernel for n in got["kernel_calls"]), got["kernel_calls"]
    assert got["steps"] and set(got["steps"]) == {5}
    assert got["forgetting_distance"] == pytest.approx(reference["forgetting_distance"], rel=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_resume_equals_uninterrupted(results, case):
    straight, resumed = load(results, f"{case}.pt"), load(results, f"{case}_resumed.pt")
    assert_params_match(resumed["masters"], straight["masters"], atol=0)
    assert_params_match(resumed["exp_avg"], straight["exp_avg"], atol=0)


@pytest.mark.parametrize("case", ["zero2", "zero3"])
@pytest.mark.parametrize("direction", ["ckpt", "ckpt1rank"])  # 2 -> 1 ranks, then 1 -> 2 ranks
def test_resume_on_another_number_of_ranks_keeps_everything(results, reference, case, direction):
    saved = read_fields(results / f"{direction}_{case}")  # the sharded checkpoint, read in this process
    loaded = load(results, f"loaded_{direction}_{case}.pt")
    for name, entry in saved.items():
        assert torch.equal(loaded["masters"][name], entry["master"]), name
        assert torch.equal(loaded["exp_avg"][name], entry["exp_avg"]), name
        if "anchor" in entry:
            assert torch.equal(loaded["anchors"][name], entry["anchor"]), name
            assert torch.equal(entry["anchor"], reference["anchors"][name]), name
    assert set(loaded["steps"]) == {3}
    assert len(loaded["anchor_numel_per_rank"]) == (1 if direction == "ckpt" else 2)
    continued = load(results, f"continued_{direction}_{case}.pt")
    assert_params_match(continued["masters"], reference["params"])


def test_corrupted_checkpoints_are_clear_errors(results):
    errors = load(results, "corrupted.pt")
    assert "no anchor (theta*) for parameter 'albert.embeddings.word_embeddings.weight'" in errors["missing"]
    assert ("anchor (theta*) for parameter 'albert.embeddings.word_embeddings.weight' has shape (9,), "
            "the parameter has (100, 16): wrong or corrupted checkpoint") in errors["misshaped"]
    assert errors["clip"].startswith("clip_and_step(max_grad_norm=1.0) but DeepSpeed clips at gradient_clipping=0.0")
