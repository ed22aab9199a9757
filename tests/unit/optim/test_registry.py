"""The registry contract and every error path of building an optimizer."""

import warnings
from typing import get_args

import pytest
import torch

from ft_framework.optim import (AnchoredOptimizer, PullOvershootWarning, available_optimizers,
                                build_optimizer, optimizer_hparams, register_optimizer)
from ft_framework.config.schema import OptimizerConfig
from ft_framework.optim import cpu as cpu_kernel
from ft_framework.optim.coefficients import StepCoefficients
from ft_framework.optim.programs import impl_names
from ft_framework.optim.registry import _REGISTRY


def test_builtin_optimizers_are_registered():
    assert {"recadam", "adamw", "bertadam", "prior_wd"} <= set(available_optimizers())


def test_unknown_name_lists_the_available_ones():
    with pytest.raises(ValueError, match=r"unknown optimizer 'radam'; available: adamw, bertadam, ewc, prior_wd, recadam"):
        build_optimizer("radam", [torch.nn.Parameter(torch.zeros(1))])


def test_unknown_hyperparameter_lists_the_valid_ones():
    with pytest.raises(TypeError, match=r"unknown hyper-parameter\(s\) \['gamma'\].*'pretrain_cof'"):
        build_optimizer("recadam", [torch.nn.Parameter(torch.zeros(1))], gamma=5000)


def test_hyperparameter_names_follow_the_authors_code():
    assert set(optimizer_hparams("recadam")) >= {"lr", "betas", "eps", "weight_decay", "correct_bias",
                                                 "anneal_fun", "anneal_k", "anneal_t0", "anneal_w", "pretrain_cof"}
    assert optimizer_hparams("recadam")["eps"] == 1e-6 and optimizer_hparams("bertadam")["correct_bias"] is False


@pytest.mark.parametrize("kwargs,match", [
    (dict(impl="cuda"), "unknown impl 'cuda'; valid: auto, cpu, triton, torch"),
    (dict(anchor_dtype="float16"), "unknown anchor_dtype 'float16'; valid: float32, bfloat16"),
    (dict(lr=-1.0), "lr must be >= 0"),
    (dict(betas=(0.9, 1.0)), r"betas must be in \[0, 1\)"),
    (dict(eps=0.0), "eps must be > 0"),
    (dict(anneal_fun="cosine"), "valid: sigmoid, linear, constant"),
    (dict(anneal_fun="linear", anneal_t0=0), "anneal_t0 must be > 0"),
    (dict(pretrain_cof=-1.0), "pretrain_cof must be >= 0"),
])
def test_bad_values_are_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_optimizer("recadam", [torch.nn.Parameter(torch.zeros(1))], **kwargs)


def test_unknown_group_key_is_an_error():
    with pytest.raises(ValueError, match=r"unknown param-group key\(s\) \['wieght_decay'\]"):
        build_optimizer("adamw", [{"params": [torch.nn.Parameter(torch.zeros(1))], "wieght_decay": 0.1}])


def test_anchor_list_and_shapes_are_checked():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="'anchors' has 2 entries but 'params' has 1"):
        build_optimizer("recadam", [{"params": [p], "anchors": [torch.zeros(3), torch.zeros(3)]}], lr=1e-5)
    with pytest.raises(ValueError, match=r"anchor shape \(4,\) does not match parameter shape \(3,\)"):
        build_optimizer("recadam", [{"params": [p], "anchors": [torch.zeros(4)]}], lr=1e-5)


def test_anchors_live_in_state_not_in_param_groups():
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    a = torch.full((3,), 2.0)
    opt = build_optimizer("recadam", [{"params": [p], "anchors": [a]}, {"params": [q]}], lr=1e-3, pretrain_cof=10.0)
    assert "anchors" not in opt.param_groups[0]
    assert [g["anchored"] for g in opt.param_groups] == [True, False]  # decided here, carried by the group
    assert torch.equal(opt.state[p]["anchor"], a) and opt.state[p]["anchor"].data_ptr() != a.data_ptr()
    assert "anchor" not in opt.state[q]
    bf = build_optimizer("recadam", [{"params": [p], "anchors": [a]}], anchor_dtype="bfloat16", lr=1e-5)
    assert bf.state[p]["anchor"].dtype == torch.bfloat16


def test_lr_and_weight_decay_are_given_once():
    p = torch.nn.Parameter(torch.zeros(3))
    for key in ("lr", "weight_decay"):
        with pytest.raises(ValueError, match=rf"^{key} given twice: every param group sets it, so build_optimizer\({key}=\.\.\.\) would be ignored"):
            build_optimizer("recadam", [{"params": [p], key: 0.01}], **{key: 0.02})
    opt = build_optimizer("recadam", [{"params": [p], "lr": 0.01}], weight_decay=0.02)  # each given once: fine
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["weight_decay"] == 0.02
    # A keyword as the default of the groups that leave it out is one spelling, as in torch.
    q = torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer("recadam", [{"params": [p]}, {"params": [q], "weight_decay": 0.0}], weight_decay=0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_a_group_is_anchored_whole_or_not_at_all():
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="must hold theta\\* for every one of its parameters"):
        build_optimizer("recadam", [{"params": [p, q], "anchors": [torch.ones(3), None]}], lr=1e-3)
    with pytest.raises(ValueError, match="must hold theta\\* for every one of its parameters"):
        build_optimizer("recadam", [{"params": [p], "anchors": [torch.ones(3)], "anchored": False}], lr=1e-3)


def test_an_anchored_group_without_theta_star_refuses_to_step():
    """A group built anchored whose theta* was never placed would otherwise run as plain Adam."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = build_optimizer("recadam", [{"params": [p], "anchored": True, "group_name": "anchored/decay"}], lr=1e-3)
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="'anchored/decay' has no theta\\* .*before the first step"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3))


def test_overshooting_pull_warns_at_build_and_at_step():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.warns(PullOvershootWarning, match="overshoots"):
        build_optimizer("recadam", [{"params": [p], "anchors": [torch.ones(2)]}], lr=1e-3,
                        pretrain_cof=5000.0, anneal_k=0.1, anneal_t0=100)  # 1e-3 * ~1 * 5000 = 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = build_optimizer("recadam", [{"params": [p], "anchors": [torch.ones(2)]}], lr=1e-5,
                              pretrain_cof=5000.0, anneal_k=0.1, anneal_t0=100)  # 0.05: fine
    opt.param_groups[0]["lr"] = 1e-3  # a schedule pushing lr up reaches it during training
    p.grad = torch.ones(2)
    with pytest.warns(PullOvershootWarning):
        opt.step()


def test_the_config_accepts_exactly_the_registered_step_programs():
    assert get_args(OptimizerConfig.model_fields["impl"].annotation) == impl_names()


def test_impl_selection():
    cpu_p = torch.nn.Parameter(torch.zeros(4))
    expected = "cpu" if cpu_kernel.kernel_available() else "torch"
    assert build_optimizer("adamw", [cpu_p]).impl == expected
    assert build_optimizer("adamw", [cpu_p], impl="torch").impl == "torch"
    f64 = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    assert build_optimizer("adamw", [f64]).impl == "torch"


@pytest.mark.skipif(not cpu_kernel.kernel_available(), reason="C++ kernel not built")
def test_cpu_impl_refuses_what_it_cannot_update_in_place():
    f64 = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(TypeError, match="impl='cpu' cannot take these parameters: parameter has dtype torch.float64"):
        build_optimizer("adamw", [f64], impl="cpu")
    p = torch.nn.Parameter(torch.zeros(4, 4))
    opt = build_optimizer("adamw", [p], impl="cpu")
    p.grad = torch.zeros(4, 4).t()  # non-contiguous gradient
    with pytest.raises(TypeError, match="gradient is not contiguous"):
        opt.step()


def test_user_registered_optimizer():
    @register_optimizer("test_signsgd")
    class SignSGD(AnchoredOptimizer):
        def __init__(self, params, lr: float = 0.1, *, impl: str = "auto"):
            super().__init__(params, dict(lr=lr, betas=(0.0, 0.0), eps=1.0, weight_decay=0.0), impl=impl)

        def coefficients(self, group, step, has_anchor):
            # beta1 = beta2 = 0: m = g, v = g^2, so m / (sqrt(v) + eps) with eps=1 is g/(|g|+1).
            return StepCoefficients(beta1=0.0, beta2=0.0, eps=1.0, step_size=group["lr"])

    try:
        assert "test_signsgd" in available_optimizers()
        assert optimizer_hparams("test_signsgd") == {"lr": 0.1}
        p = torch.nn.Parameter(torch.zeros(2))
        opt = build_optimizer("test_signsgd", [p], lr=0.5)
        p.grad = torch.tensor([1.0, -3.0])
        opt.step()
        torch.testing.assert_close(p.detach(), torch.tensor([-0.25, 0.375]))
        with pytest.raises(ValueError, match="already registered"):
            register_optimizer("test_signsgd")(SignSGD)
    finally:
        _REGISTRY.pop("test_signsgd", None)


def test_factory_without_impl_argument():
    @register_optimizer("test_sgd")
    def make_sgd(params, lr: float = 0.1):
        return torch.optim.SGD(params, lr=lr)

    try:
        p = torch.nn.Parameter(torch.zeros(1))
        assert isinstance(build_optimizer("test_sgd", [p], lr=0.2), torch.optim.SGD)
        with pytest.raises(ValueError, match="has no 'cpu' implementation"):
            build_optimizer("test_sgd", [p], impl="cpu")
    finally:
        _REGISTRY.pop("test_sgd", None)
