"""One exact program in every implementation: the fp32 state stores the same bits at every SIMD level
of the C++ kernel and on the torch path (cpp/step_body.h, optim/torch_step.py exact_change), as the
compact state does (test_compact_state.py). The float64-reference tests (test_optim_numerics.py,
test_cpu_kernel.py) say the program is right; these say every implementation runs the same one."""

import pytest
import torch

from ft_framework.optim import build_optimizer
from ft_framework.optim import cpu as cpu_kernel
from ft_framework.optim import torch_step
from rule_hparams import RULE_HPARAMS as HPARAMS
from simd_levels import SIMD_LEVELS, level_or_skip

ANCHORED_SIZES = (1, 7, 4096, 65537)  # tails at every vector width, one tensor past a 64 Ki boundary
HEAD_SIZES = (3,)
STEPS = 3


def fp32_run(rule: str, path: str, anchor_dtype: str = "float32") -> list[torch.Tensor]:
    """STEPS steps of `rule` on `path` ("torch" or a SIMD level): every parameter, m and v."""
    if path != "torch":
        level_or_skip(path)
        cpu_kernel.set_simd_level(path)
    gen = torch.Generator().manual_seed(11)
    thetas = [torch.randn(n, generator=gen) * 0.05 for n in ANCHORED_SIZES]
    anchored = [torch.nn.Parameter(t + torch.randn(t.shape, generator=gen) * 1e-3) for t in thetas]
    head = [torch.nn.Parameter(torch.randn(n, generator=gen) * 0.05) for n in HEAD_SIZES]
    opt = build_optimizer(rule, [{"params": anchored, "anchors": thetas}, {"params": head}],
                          impl="torch" if path == "torch" else "cpu", anchor_dtype=anchor_dtype, **HPARAMS[rule])
    params = anchored + head
    for _ in range(STEPS):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [x.detach().clone() for p in params for x in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]


def assert_same_bits(got: list[torch.Tensor], want: list[torch.Tensor], label: str) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g.view(torch.int32), w.view(torch.int32)), (
            f"{label}: tensor {i} differs in {(g.view(torch.int32) != w.view(torch.int32)).sum()} elements")


@pytest.mark.usefixtures("restore_level")
@pytest.mark.parametrize("anchor_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("path", SIMD_LEVELS[1:] + ["torch"])
@pytest.mark.parametrize("rule", sorted(HPARAMS))
def test_fp32_state_is_bit_equal_to_the_scalar_kernel(rule, path, anchor_dtype):
    """recadam (pulls), adamw (pre-decay), bertadam, prior_wd (pre-pull): every stage of the program."""
    level_or_skip("scalar")
    want = fp32_run(rule, "scalar", anchor_dtype)
    assert_same_bits(fp32_run(rule, path, anchor_dtype), want, f"{rule} on {path}")


@pytest.mark.usefixtures("restore_level")
def test_a_fused_lerp_on_the_torch_path_is_caught(monkeypatch):
    """The comparison has teeth: torch's lerp (the old program's post pull) rounds differently."""
    level_or_skip("scalar")
    want = fp32_run("recadam", "scalar")

    def fused_lerp_(es, xs, w):
        torch._foreach_lerp_(es, xs, w)

    monkeypatch.setattr(torch_step, "_lerp_", fused_lerp_)
    with pytest.raises(AssertionError, match="differs"):
        assert_same_bits(fp32_run("recadam", "torch"), want, "fused torch")
