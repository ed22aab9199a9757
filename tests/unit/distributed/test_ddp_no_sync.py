"""DDP honours last_micro_batch: over an accumulation of 4 micro-batches the gradients are
all-reduced once per step (counted by a DDP communication hook on 2 gloo ranks), and the step
equals one step on the whole batch without accumulation. In the same launch: activation
checkpointing under DDP (no_sync accumulation included) gives the gradients of the run without it,
bit for bit, with dropout and Mixout on."""

import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from ft_framework.models.activation_checkpointing import apply_activation_checkpointing, checkpointed_blocks
from ft_framework.models.loading import apply_mixout
from ft_framework.strategies.ddp import DDPStrategy

ACCUM, MICRO = 4, 2  # per rank: 4 micro-batches of 2 examples


class _Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(6, 5)
        self.out = nn.Linear(5, 1)

    def forward(self, x, y):
        pred = self.out(torch.tanh(self.hidden(x))).squeeze(-1)
        return SimpleNamespace(loss=((pred - y) ** 2).mean())


def _counting_hook(counter, bucket):
    counter["calls"] += 1
    return allreduce_hook(None, bucket)


def _one_step(strategy, x, y, accumulate: bool, honour_last: bool = True):
    counter = {"calls": 0}
    strategy.model.register_comm_hook(counter, _counting_hook)
    chunks = list(zip(x.split(MICRO), y.split(MICRO))) if accumulate else [(x, y)]
    for i, (xb, yb) in enumerate(chunks):
        last = i == len(chunks) - 1 or not honour_last
        out = strategy.forward({"x": xb, "y": yb}, last_micro_batch=last)
        strategy.backward(out.loss / len(chunks), last_micro_batch=last)
    strategy.clip_and_step(None)
    return counter["calls"], {n: p.detach().clone() for n, p in strategy.unwrapped_model().named_parameters()}


def _setup(seed=3):
    torch.manual_seed(seed)
    strategy = DDPStrategy(device="cpu")
    strategy.setup(_Regressor(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    return strategy


def _bert_steps(rank: int, checkpointing: bool):
    """2 steps of 2 micro-batches (the first under no_sync) of a tiny BERT with dropout and Mixout:
    each step's all-reduced gradients and the final weights."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=20))
    pretrained = {n: p.detach() + 0.02 for n, p in model.named_parameters() if not n.startswith("classifier")}
    apply_mixout(model, 0.3, pretrained)
    if checkpointing:
        apply_activation_checkpointing(model)
    strategy = DDPStrategy(device="cpu")
    strategy.setup(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    data = torch.Generator().manual_seed(21 + rank)
    grads = []
    for step in range(2):
        torch.manual_seed(100 * rank + step)  # dropout and Mixout: other masks on each rank
        for micro in range(2):
            batch = {"input_ids": torch.randint(0, 50, (2, 8), generator=data),
                     "labels": torch.randint(0, 2, (2,), generator=data)}
            last = micro == 1
            strategy.backward(strategy.forward(batch, last_micro_batch=last).loss / 2, last_micro_batch=last)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        strategy.clip_and_step(None)
    return {"grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "blocks": len(checkpointed_blocks(model))}


def _worker(rank, port, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    data = torch.Generator().manual_seed(11 + rank)  # each rank its own examples
    x, y = torch.randn(ACCUM * MICRO, 6, generator=data), torch.randn(ACCUM * MICRO, generator=data)
    result = {}
    result["accum_calls"], result["accum"] = _one_step(_setup(), x, y, accumulate=True)
    result["whole_calls"], result["whole"] = _one_step(_setup(), x, y, accumulate=True, honour_last=False)
    result["batch_calls"], result["batch"] = _one_step(_setup(), x, y, accumulate=False)
    result["bert_plain"] = _bert_steps(rank, checkpointing=False)
    result["bert_checkpointed"] = _bert_steps(rank, checkpointing=True)
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_reduces_once_per_accumulated_step_and_equals_no_accumulation(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        # The tiny model fits one bucket: one all-reduce per step with no_sync, one per micro-batch without.
        assert r["batch_calls"] == 1
        assert r["accum_calls"] == 1
        assert r["whole_calls"] == ACCUM
        for name, value in r["batch"].items():
            torch.testing.assert_close(r["accum"][name], value, rtol=1e-6, atol=1e-7, msg=name)
            torch.testing.assert_close(r["whole"][name], value, rtol=1e-6, atol=1e-7, msg=name)
    first, second = (torch.load(tmp_path / f"rank{r}.pt")["accum"] for r in (0, 1))
    assert all(torch.equal(first[n], second[n]) for n in first)  # the replicas agree
    for rank in (0, 1):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        plain, checkpointed = r["bert_plain"], r["bert_checkpointed"]
        assert plain["blocks"] == 0 and checkpointed["blocks"] == 2
        for step, grads in enumerate(plain["grads"]):
            assert all(torch.equal(checkpointed["grads"][step][n], g) for n, g in grads.items()), step
        assert all(torch.equal(checkpointed["params"][n], p) for n, p in plain["params"].items())
