"""The sharded checkpoint layout across engines and world sizes (2 gloo ranks on CPU).

reshard_worker.py runs every case in three steps of forked ranks (2 ranks, 1 rank, 2 ranks) from
one process (rank_launcher.py); this module checks what they wrote by reading the checkpoints
offline in this process:

- loaded state is exact: a checkpoint saved right after a load equals its source bit for bit
  (masters, moments, anchors, steps), under any other engine and world size;
- the source itself is the one-process reference at step 3 (1e-6: reduction order only);
- training continued after the load equals the one-process reference within 1e-6, and
  theta* stays exactly the pretrained values (also after bf16 mixed precision);
- a same-size resume is bit-exact with the uninterrupted run;
- a run that anchors refuses a checkpoint without anchors (every rank, no hang).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from rank_launcher import launch, step  # noqa: E402
from reshard_common import HPARAMS, STEPS, make_model_and_anchors, reference  # noqa: E402
from ft_framework.checkpointing.dcp_read import read_whole_checkpoint
from ft_framework.checkpointing.fragments import parse_param_key

pytestmark = pytest.mark.slow
ATOL = 1e-6


def save_without_anchors(directory: Path) -> None:
    """A one-process checkpoint of the same model whose optimizer anchors nothing."""
    from ft_framework.optim import build_optimizer
    from ft_framework.optim.groups import build_param_groups
    from ft_framework.strategies import SingleDeviceStrategy

    strategy = SingleDeviceStrategy("fp32", "cpu")
    model, _ = make_model_and_anchors("RI")
    strategy.setup(model, lambda m: build_optimizer("recadam", build_param_groups(m, None, lr=1e-3), impl="torch",
                                                  **HPARAMS))
    directory.mkdir(parents=True)
    strategy.save_checkpoint(directory)


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = tmp_path_factory.mktemp("reshard")
    save_without_anchors(out / "no_anchor")
    launch(HERE / "reshard_worker.py", [step("save", 2, out=out), step("one", 1, out=out), step("two", 2, out=out)],
           out, timeout=900)
    return out


@pytest.fixture(scope="module")
def refs():
    return {mode: reference(mode) for mode in ("PI", "RI")}


def read(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{parameter: {field: full tensor}} of a sharded checkpoint, read in this process."""
    flat = read_whole_checkpoint(directory)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        parsed = parse_param_key(key)
        if parsed:
            out.setdefault(parsed[0], {})[parsed[1]] = value
    return out


def assert_identical(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name in want:
        assert set(got[name]) == set(want[name]), name
        for field in want[name]:
            a, b = got[name][field], want[name][field]
            assert a.dtype == b.dtype and torch.equal(a, b), f"{name}/{field}"


def assert_matches_reference_state(got: dict, ref: dict) -> None:
    shapes = {n: v["master"].shape for n, v in ref["state"].items()}
    for name, fields in ref["state"].items():
        for field, want in fields.items():
            value = got[name][field]
            value = value if field == "step" else value.view(shapes[name])
            torch.testing.assert_close(value.float(), want.float(), rtol=0, atol=ATOL, msg=f"{name}/{field}")
        if name in ref["anchors"]:
            assert torch.equal(got[name]["anchor"].view(shapes[name]), ref["anchors"][name]), name
        else:
            assert "anchor" not in got[name], name


def assert_continued(got: dict, ref: dict) -> None:
    for name, want in ref["params"].items():
        torch.testing.assert_close(got[name]["master"].view(want.shape), want, rtol=0, atol=ATOL, msg=name)
        assert float(got[name]["step"]) == STEPS, name
        if name in ref["anchors"]:
            assert torch.equal(got[name]["anchor"].view(want.shape), ref["anchors"][name]), name


SOURCES = [("zero2_2", "RI"), ("fsdp_2", "PI"), ("zero1_1", "RI")]
RESUMES = [  # (case, source checkpoint, init mode)
    ("zero2_2_to_fsdp_1", "zero2_2", "RI"),          # ZeRO-2 on 2 -> FSDP2 on 1
    ("fsdp_2_to_zero3_2", "fsdp_2", "PI"),           # FSDP2 on 2 -> ZeRO-3 on 2
    ("zero1_1_to_zero3off_2", "zero1_1", "RI"),      # ZeRO-1 on 1 -> ZeRO-3 + offload on 2
    ("zero2_2_to_single", "zero2_2", "RI"),          # DeepSpeed -> single
    ("zero2_2_to_zero2_2", "zero2_2", "RI"),         # same engine, same size
    ("fsdp_2_to_ddp_2", "fsdp_2", "PI"),             # FSDP2 -> DDP (whole tensors, rank 0 writes)
]


@pytest.mark.parametrize("source,mode", SOURCES)
def test_saved_state_is_the_reference_state(out, refs, source, mode):
    assert_matches_reference_state(read(out / source), refs[mode])


@pytest.mark.parametrize("case,source,mode", RESUMES)
def test_loaded_state_is_exact(out, case, source, mode):
    assert_identical(read(out / f"{case}_loaded"), read(out / source))


@pytest.mark.parametrize("case,source,mode", RESUMES)
def test_continued_training_equals_reference(out, refs, case, source, mode):
    assert_continued(read(out / f"{case}_final"), refs[mode])


def test_same_size_resume_is_bit_exact(out):
    assert_identical(read(out / "zero2_2_to_zero2_2_final"), read(out / "zero2_2_straight"))


def test_mixed_precision_keeps_theta_star_exact(out, refs):
    ref = refs["RI"]
    for directory in ("zero2bf16_2", "zero2bf16_2_to_single_loaded", "zero2bf16_2_to_single_final"):
        got = read(out / directory)
        for name, anchor in ref["anchors"].items():
            assert got[name]["anchor"].dtype == torch.float32
            assert torch.equal(got[name]["anchor"].view(anchor.shape), anchor), (directory, name)
    assert_identical(read(out / "zero2bf16_2_to_single_loaded"), read(out / "zero2bf16_2"))


def test_every_rank_wrote_its_own_fragments(out):
    files = sorted(p.name for p in (out / "zero2_2").glob("*.distcp"))
    assert files == ["__0_0.distcp", "__1_0.distcp"]
    sizes = [(out / "zero2_2" / f).stat().st_size for f in files]
    assert min(sizes) > 0.3 * max(sizes), sizes  # both ranks hold about half the state
    manifest = json.loads((out / "zero2_2" / "ft_checkpoint.json").read_text())
    assert manifest["saved_by"]["world_size"] == 2 and manifest["saved_by"]["strategy"] == "deepspeed"


def test_missing_anchor_is_a_clear_error(out):
    errors = json.loads((out / "errors_save.json").read_text())
    assert "has no anchor (theta*) for parameter" in errors["missing_anchor"], errors
