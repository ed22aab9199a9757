"""The lm-eval model over our forward (models/lm_benchmarks.py) answers every request as lm-eval's
own Hugging Face model (HFLM) does on the same directory: loglikelihoods and their greedy flags
(empty contexts, trailing spaces, left truncation past the model's length), rolling loglikelihoods
over several windows, and greedy generations cut at stop sequences, whatever the batch size; two
"ranks" (each a share of the requests, gathered) answer as one; the suite refuses what it cannot
score in one line."""

from __future__ import annotations

import pytest
import torch

from lm_eval_tasks import write_lm_eval_tasks
from tiny_llm import build_tiny_llm_dir
from ft_framework.errors import UserError
from ft_framework.models.lm_benchmarks import BenchmarkSuite, BenchmarkTask, benchmark_forgetting, is_rate

pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("lm_benchmarks_unit")
    model_dir = build_tiny_llm_dir(root / "llama", "llama", seed=3)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf = HFLM(pretrained=str(model_dir), dtype="float32", batch_size=1, device="cpu", max_length=48)
    mc, gen, text = write_lm_eval_tasks(root / "tasks")
    return {"model": model, "tokenizer": AutoTokenizer.from_pretrained(model_dir), "hf": hf, "tasks": (mc, gen, text)}


def suite(tiny, batch_size: int, rank: int = 0, world_size: int = 1, gather=lambda obj: [obj]) -> BenchmarkSuite:
    return BenchmarkSuite([BenchmarkTask(path=str(tiny["tasks"][0]))], tokenizer=tiny["tokenizer"], model=tiny["model"],
                          batch_size=batch_size, rank=rank, world_size=world_size, device=torch.device("cpu"),
                          gather=gather)


def ours(tiny, batch_size: int, forward=None, **kwargs):
    lm = suite(tiny, batch_size, **kwargs)._lm(forward or (lambda batch: tiny["model"](**batch)))
    lm._max_length = 48  # as HFLM(max_length=48): long requests are truncated on the left
    return lm


def instances(kind: str, args: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


LOGLIKELIHOOD = [("Reverse: cat dog\nAnswer:", " dog cat"), ("", "hello world"), ("Q: a  ", " b"), ("abc", "d"),
                 ("a long context " * 6, " that is cut on the left"), ("x", "y" * 30)]


@pytest.mark.parametrize("batch_size", [1, 4])
def test_loglikelihoods_equal_hflms(tiny, batch_size):
    requests = instances("loglikelihood", LOGLIKELIHOOD)
    want = tiny["hf"].loglikelihood(requests)
    got = ours(tiny, batch_size).loglikelihood(requests)
    assert [g[1] for g in got] == [w[1] for w in want]
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], rel=1e-6, abs=1e-5)


def test_rolling_loglikelihoods_equal_hflms_over_several_windows(tiny):
    requests = instances("loglikelihood_rolling", [("some text " * 12,), ("short",), ("another line\n" * 5,)])
    want = tiny["hf"].loglikelihood_rolling(requests)
    assert ours(tiny, 2).loglikelihood_rolling(requests) == pytest.approx(want, rel=1e-6)


def test_greedy_generations_equal_hflms_with_their_stop_sequences(tiny):
    contexts = ["Reverse: cat", "Reverse: sun moon fish\nAnswer:", "x", "a somewhat longer prompt " * 2]
    plain = tiny["hf"].generate_until(instances("generate_until", [(c, {"max_gen_toks": 12}) for c in contexts]))
    # Stop sequences the model does write: each cuts some generations short, not all at one place.
    stops = sorted({text[3] for text in plain if len(text) > 3})[:2]
    requests = instances("generate_until", [(c, {"until": stops, "max_gen_toks": 12, "do_sample": False})
                                            for c in contexts])
    want = tiny["hf"].generate_until(requests)
    assert want != plain and any(len(w) < len(p) for w, p in zip(want, plain))
    for batch_size in (1, 3):
        assert ours(tiny, batch_size).generate_until(requests) == want
        assert ours(tiny, batch_size).generate_until(
            instances("generate_until", [(c, {"max_gen_toks": 12}) for c in contexts])) == plain


def test_two_ranks_shares_gathered_equal_one_process(tiny):
    """Two "ranks" as two threads of this process, each scoring its share of the requests (padded to
    the same batches) and gathering the other's through a barrier, as the strategy's gather does."""
    import threading

    slots, barrier = [None, None], threading.Barrier(2)
    forwards, answers = [0, 0], [None, None]

    def gather(rank: int, obj):
        slots[rank] = obj
        barrier.wait()
        both = list(slots)
        barrier.wait()
        return both

    def forward(rank: int, batch):
        forwards[rank] += 1
        return tiny["model"](**batch)

    def run(rank: int, kind: str, requests) -> None:
        lm = ours(tiny, 2, forward=lambda batch: forward(rank, batch), rank=rank, world_size=2,
                  gather=lambda obj: gather(rank, obj))
        answers[rank] = getattr(lm, kind)(requests)

    contexts = ["Reverse: cat", "Reverse: sun moon fish\nAnswer:", "x", "a somewhat longer prompt", "yz"]
    cases = [("loglikelihood", instances("loglikelihood", LOGLIKELIHOOD[:5])),  # odd: rank 1's share is padded
             ("generate_until", instances("generate_until", [(c, {"until": ["e"], "max_gen_toks": 10})
                                                             for c in contexts]))]
    for kind, requests in cases:
        threads = [threading.Thread(target=run, args=(rank, kind, requests)) for rank in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        one = getattr(ours(tiny, 2), kind)(requests)
        assert answers[0] == answers[1]
        if kind == "loglikelihood":
            assert [a[1] for a in answers[0]] == [o[1] for o in one]
            assert [a[0] for a in answers[0]] == pytest.approx([o[0] for o in one], rel=1e-6)
        else:
            assert answers[0] == one
        assert forwards[0] == forwards[1]  # the same number of (collective) forwards on both ranks


def test_a_sampling_task_and_an_unknown_task_are_refused_in_one_line(tiny, tmp_path):
    requests = instances("generate_until", [("x", {"do_sample": True, "max_gen_toks": 4})])
    with pytest.raises(UserError, match="decode greedily"):
        ours(tiny, 1).generate_until(requests)
    with pytest.raises(UserError, match=r"tasks\[0\]\.path: .* is not a file"):
        BenchmarkSuite([BenchmarkTask(path=str(tmp_path / "none.yaml"))], tokenizer=tiny["tokenizer"],
                       model=tiny["model"], batch_size=1, rank=0, world_size=1, device=torch.device("cpu"),
                       gather=lambda obj: [obj])


def test_the_mean_drop_over_the_rate_scored_tasks_is_the_benchmark_forgetting():
    acc = {"score": 0.5, "theta_star": 0.75, "drop": 0.25, "higher_is_better": True}
    exact = {"score": 0.3, "theta_star": 0.25, "drop": -0.05, "higher_is_better": True}
    perplexity = {"score": 40.0, "theta_star": 30.0, "drop": 10.0, "higher_is_better": False}
    bleu = {"score": 20.0, "theta_star": 25.0, "drop": 5.0, "higher_is_better": True}
    assert [is_rate(s) for s in (acc, exact, perplexity, bleu)] == [True, True, False, False]
    # A perplexity's rise or a BLEU's points are another unit: reported per task, never averaged.
    scores = {n: {**s, "rate": is_rate(s)} for n, s in zip("abcd", (acc, exact, perplexity, bleu))}
    assert benchmark_forgetting(scores) == pytest.approx(0.1)
    assert benchmark_forgetting({"c": scores["c"]}) is None and benchmark_forgetting({}) is None


def test_a_generation_longer_than_the_model_reads_is_refused_in_one_line(tiny):
    requests = instances("generate_until", [("x", {"until": ["e"], "max_gen_toks": 48})])
    with pytest.raises(UserError, match=r"generates up to 48 tokens .* reads at most 48; .* below 48$"):
        ours(tiny, 1).generate_until(requests)
