"""forgetting_sq_sum in fp64 chunks equals an independent whole-tensor fp64 reference, for
tensors spanning several chunks, a partial last chunk, bf16 anchors and parameters without one."""

import torch

from ft_framework.optim import RecAdam
from ft_framework.optim import base as optim_base


def test_chunked_forgetting_distance_matches_fp64_reference():
    g = torch.Generator().manual_seed(7)
    sizes = [3 * optim_base._FORGETTING_CHUNK + 17, 5, optim_base._FORGETTING_CHUNK]
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]
    anchors = [p.detach() + 1e-3 * torch.randn(p.shape, generator=g) for p in params]
    free = torch.nn.Parameter(torch.randn(11, generator=g))  # not anchored: not counted
    for anchor_dtype in ("float32", "bfloat16"):
        opt = RecAdam([{"params": params, "anchors": anchors}, {"params": [free]}], lr=1e-3,
                      impl="torch", anchor_dtype=anchor_dtype)
        stored = [opt.state[p]["anchor"] for p in params]
        expected = sum(float(((p.detach().double() - a.double()) ** 2).sum()) for p, a in zip(params, stored))
        assert opt.forgetting_sq_sum().dtype == torch.float64
        assert abs(float(opt.forgetting_sq_sum()) - expected) <= 1e-12 * expected
        assert abs(opt.forgetting_distance() - expected ** 0.5) <= 1e-12 * expected ** 0.5


def test_forgetting_distance_restores_the_thread_count():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        p = torch.nn.Parameter(torch.ones(4))
        opt = RecAdam([{"params": [p], "anchors": [torch.zeros(4)]}], lr=1e-3, impl="torch")
        assert opt.forgetting_distance() == 2.0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
