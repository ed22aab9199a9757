"""Benchmarks as LLM users score them: lm-evaluation-harness tasks (multiple choice through
loglikelihood, perplexity through loglikelihood_rolling, generation through generate_until) scored
on the run's live model, through the strategy's forward, under every strategy; θ*'s scores (the
model before its first step), kept in the run's directory, and each task's drop from them.

    suite = BenchmarkSuite(tasks, tokenizer=..., model=loaded.model, batch_size=8, rank=..., world_size=...,
                           device=..., gather=strategy.gather_objects)
    suite.reference_from_model(strategy.forward, keep_in=run_paths.benchmark_reference, ...)  # θ*, fresh run
    suite.reference_from_run(saved_in, keep_in, ...)                                          # a resumed run
    suite.measure(strategy.forward)   # {task: {metric, score, stderr, theta_star, theta_star_stderr, drop}}

This module is the one adapter of lm-eval (0.4.13 and the releases its extra allows): the model
interface lm-eval calls is its own Hugging Face model class (HFLM) with the model's call and greedy
generation replaced by our forward, so that requests are tokenized, truncated, batched and read back
exactly as `lm_eval --model hf` does on an exported directory (HFLM's private attributes are set
here, nowhere else). Every rank runs lm-eval's evaluator on the same requests; each rank scores a
share of them (padded to the same number of batches, since a sharded model's forward is collective)
and the shares are gathered, so every rank holds every answer and the same scores.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ft_framework import resources
from ft_framework.errors import UserError, did_you_mean, quoted
from ft_framework.user_files import MissingFile, read_json

logger = logging.getLogger(__name__)

__all__ = ["BENCHMARK_FORGETTING", "BenchmarkSuite", "BenchmarkTask", "LM_EVAL_SPECIFIER", "benchmark_forgetting",
           "check_lm_eval_version", "is_rate"]

Forward = Callable[[dict[str, torch.Tensor]], Any]

# results.json's name of the mean drop over the tasks scored by a rate: the run's benchmark forgetting.
BENCHMARK_FORGETTING = "benchmark_forgetting"
# The lm-eval releases this adapter was written against (HFLM's attributes and methods it reads).
LM_EVAL_VERSIONS = ((0, 4, 13), (0, 5, 0))  # [first, last) as (major, minor, micro)
# The same range as a pip specifier: pyproject's lm_eval extra (tests/unit/project/test_packaging.py keeps them equal).
LM_EVAL_SPECIFIER = (f">={'.'.join(map(str, LM_EVAL_VERSIONS[0]))},"
                     f"<{'.'.join(map(str, LM_EVAL_VERSIONS[1][:2]))}")
_REFERENCE_VERSION = 1


def check_lm_eval_version() -> None:
    """lm-eval importable, in the adapter's range; else one line saying what to install."""
    try:
        import lm_eval
    except ImportError:
        raise UserError("evaluation.benchmarks needs lm-evaluation-harness: pip install 'ft_framework[lm_eval]' "
                        f"(lm-eval{LM_EVAL_SPECIFIER})") from None
    found = tuple(int(p) for p in lm_eval.__version__.split(".")[:3] if p.isdigit())
    if not LM_EVAL_VERSIONS[0] <= found < LM_EVAL_VERSIONS[1]:
        raise UserError(f"evaluation.benchmarks needs lm-eval{LM_EVAL_SPECIFIER}; {lm_eval.__version__} is installed: "
                        "pip install 'ft_framework[lm_eval]'")


@dataclass(frozen=True)
class BenchmarkTask:
    """One task as evaluation.benchmarks.tasks names it: lm-eval's name (or a shipped task's), or a
    path to a task YAML; how many documents (None: all) and few-shot examples (None: the task's)."""

    name: str | None = None
    path: str | None = None
    limit: int | None = None
    num_fewshot: int | None = None

    def identity(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "limit": self.limit, "num_fewshot": self.num_fewshot}


def is_rate(score: dict[str, Any]) -> bool:
    """Whether a task's score is a rate (accuracy, exact match, F1 ...: higher is better, θ*'s score
    and the model's both in [0, 1]), the one unit a mean drop over tasks may average. A perplexity
    or bits per byte (lower is better) or a BLEU in 0-100 is reported per task, never averaged."""
    return bool(score.get("higher_is_better", True)) and all(
        isinstance(score.get(key), (int, float)) and 0.0 <= score[key] <= 1.0 for key in ("score", "theta_star"))


def benchmark_forgetting(scores: dict[str, dict[str, Any]]) -> float | None:
    """The mean drop from θ* over the tasks scored by a rate (measure's "rate": is_rate); None where
    there is none."""
    drops = [s["drop"] for s in scores.values() if s["rate"]]
    return float(np.mean(drops)) if drops else None


# ---- the model lm-eval calls --------------------------------------------------------------------
def _forward_lm_class():
    """HFLM with our forward in place of the model's call and of transformers' generate (built on
    first use: importing lm-eval imports transformers and accelerate)."""
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.utils import configure_pad_token, resolve_max_length
    from lm_eval.models.utils_hf import stop_sequences_criteria

    class ForwardLM(HFLM):
        """lm-eval's HFLM over a forward callable: tokenization, truncation, batching and the reading
        of the answers are HFLM's own; each forward is ours."""

        def __init__(self, *, forward: Forward, tokenizer: Any, config: Any, eos_token_ids: Sequence[int],
                     batch_size: int, device: torch.device, rank: int, world_size: int,
                     gather: Callable[[Any], list[Any]]):
            super(HFLM, self).__init__()  # TemplateLM's: lm-eval sees one process (every rank runs it whole)
            self._forward, self._gather = forward, gather
            self._share_rank, self._share_world = rank, world_size
            self._model, self._config, self._device = None, config, device
            self.backend = "causal"
            self.tokenizer = configure_pad_token(tokenizer, model_config=config)
            self.vocab_size = self.tokenizer.vocab_size
            self.add_bos_token = None
            self.custom_prefix_token_id = None
            self._max_length = None
            # One model row per request: HFLM's one-token-continuation cache would give the ranks'
            # shares different numbers of batches (the same answers either way).
            self.logits_cache = False
            self.truncation = False
            self.batch_size_per_gpu = batch_size
            self.batch_schedule, self.batch_sizes, self.max_batch_size = 1, {}, batch_size
            self.softmax_dtype = None
            self.mixed_precision_dtype = None
            self.think_end_token = None
            self.enable_thinking = None
            self.chat_template_args = {}
            self.pretrained, self.revision, self.peft, self.delta = "ft_framework", "live", None, None
            self._eos_ids = set(eos_token_ids)

        @property
        def model(self):
            return None

        @property
        def max_length(self) -> int:
            if self._max_length:  # as HFLM's max_length argument
                return self._max_length
            return resolve_max_length(self._config, self.tokenizer, default=self._DEFAULT_MAX_LENGTH)

        def get_model_info(self) -> dict:
            return {}

        def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
            # As HFLM calls a causal model: right-padded rows, no mask (causality keeps the padding
            # after each row's tokens out of its logits).
            return self._forward({"input_ids": inps.to(self._device), "use_cache": False}).logits

        # ---- each rank scores a share -----------------------------------------------------------
        def _shares(self, items: list[Any]) -> tuple[list[Any], int]:
            """This rank's share of `items` (every world_size-th), padded with a repeat so that every
            rank's share has the same length; and the number of real items in it."""
            mine = items[self._share_rank::self._share_world]
            size = math.ceil(len(items) / self._share_world)
            return mine + [items[0]] * (size - len(mine)), len(mine)

        def _gathered(self, items: list[Any], answer: Callable[[list[Any]], list[Any]]) -> list[Any]:
            if not items:
                return []
            share, real = self._shares(items)
            answers = answer(share)[:real]
            out: list[Any] = [None] * len(items)
            for rank, theirs in enumerate(self._gather(answers)):
                out[rank::self._share_world] = theirs
            return out

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
            return self._gathered(list(requests), lambda share: HFLM._loglikelihood_tokens(
                self, share, disable_tqdm=True, override_bs=override_bs))

        def generate_until(self, requests, disable_tqdm: bool = False):
            # One generation setting at a time, so that every rank's share cuts into the same batches.
            groups: dict[str, list[int]] = {}
            for i, request in enumerate(requests):
                wanted = request.args[1].get("max_gen_toks", self.max_gen_toks)
                if wanted >= self.max_length:  # HFLM would cut the context to nothing and fail deep inside
                    raise UserError(f"evaluation.benchmarks: task {request.task_name} generates up to "
                                    f"{wanted} tokens (max_gen_toks) but the model reads at most {self.max_length}; "
                                    f"give the task a generation_kwargs.max_gen_toks below {self.max_length}")
                groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
            out: list[Any] = [None] * len(requests)
            for indices in groups.values():
                answers = self._gathered([requests[i] for i in indices], lambda share: HFLM.generate_until(
                    self, share, disable_tqdm=True))
                for i, answer in zip(indices, answers):
                    out[i] = answer
            return out

        @torch.no_grad()
        def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **kwargs) -> torch.Tensor:
            """Greedy decoding as transformers' generate does it for HFLM: a row ends at an
            end-of-sequence token (padding after it), all rows end when one stop sequence ended every
            row (lm-eval's criteria) or at `max_length`. Every rank makes as many forwards as the
            longest rank needs (a sharded model's forward is collective); the rows are cut where
            this rank's generation would have stopped."""
            if kwargs.get("do_sample"):
                raise UserError("evaluation.benchmarks: a task samples its generations (do_sample: true); the "
                                "benchmarks decode greedily, as lm-eval does with temperature 0")
            attention = kwargs["attention_mask"].to(self._device).long()
            input_ids = context.to(self._device)
            rows, width = input_ids.shape
            pad = self.tokenizer.pad_token_id
            criteria = stop_sequences_criteria(self.tokenizer, stop, width, rows)
            unfinished = torch.ones(rows, dtype=torch.bool, device=self._device)
            positions = (attention.cumsum(-1) - 1).clamp(min=0)
            out = self._forward({"input_ids": input_ids, "attention_mask": attention, "position_ids": positions,
                                 "use_cache": True})
            cache_key = "cache" if "cache" in out.keys() else "past_key_values"
            last = positions[:, -1:]
            generated, ended_at = input_ids, None
            for step in range(max_length - width):
                token = out.logits[:, -1].argmax(-1)
                token = torch.where(unfinished, token, torch.full_like(token, pad))
                generated = torch.cat([generated, token[:, None]], dim=1)
                if ended_at is None:
                    unfinished &= ~torch.isin(token, torch.tensor(sorted(self._eos_ids), device=self._device))
                    if any([bool(c(generated, None)) for c in criteria]):  # every criterion sees each step
                        unfinished[:] = False
                    if not bool(unfinished.any()):
                        ended_at = generated.shape[1]
                if step + 1 == max_length - width or all(self._gather(ended_at is not None)):
                    break
                attention = torch.cat([attention, attention.new_ones((rows, 1))], dim=1)
                out = self._forward({"input_ids": token[:, None], "attention_mask": attention,
                                     "position_ids": last + step + 1, cache_key: out[cache_key], "use_cache": True})
            return generated[:, :ended_at] if ended_at is not None else generated

    return ForwardLM


# ---- the suite ----------------------------------------------------------------------------------
class BenchmarkSuite:
    """The run's lm-eval tasks, θ*'s scores on them and the live model's (collective: every rank
    calls each method with the strategy's forward)."""

    def __init__(self, tasks: Sequence[BenchmarkTask], *, tokenizer: Any, model: Any, batch_size: int, rank: int,
                 world_size: int, device: torch.device, gather: Callable[[Any], list[Any]]):
        check_lm_eval_version()
        self.tasks = list(tasks)
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.device, self.gather = device, gather
        # lm-eval may give a tokenizer without one a pad token: its own copy, not the run's.
        self.tokenizer = copy.deepcopy(tokenizer)
        self.config = model.config
        generation = getattr(model, "generation_config", None)
        eos = getattr(generation, "eos_token_id", None)
        if eos is None:
            eos = getattr(model.config, "eos_token_id", None)
        self.eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.task_manager = self._task_manager()
        self.names = [self._task_name(t) for t in self.tasks]
        self.reference: dict[str, dict[str, Any]] | None = None
        self.seconds = 0.0

    def _task_manager(self):
        """lm-eval's index of the tasks: the shipped ones and the directories of the YAML paths; its
        own (thousands of YAML files, seconds to index) only when a name is not among those."""
        from lm_eval.tasks import TaskManager

        # The shipped tasks (resources/benchmarks/) resolve by name like lm-eval's own.
        include = [resources.benchmarks_dir()] if resources.benchmarks_dir().is_dir() else []
        for i, task in enumerate(self.tasks):
            if task.path is not None:
                path = Path(task.path).expanduser()
                if not path.is_file():
                    raise UserError(f"evaluation.benchmarks.tasks[{i}].path: {task.path} is not a file; give an "
                                    "lm-eval task YAML")
                if path.resolve().parent not in include:
                    include.append(path.resolve().parent)
        manager = TaskManager(include_path=include or None, include_defaults=False)
        if any(t.name is not None and t.name not in manager.all_tasks for t in self.tasks):
            manager = TaskManager(include_path=include or None, include_defaults=True)
        for i, task in enumerate(self.tasks):
            if task.name is not None and task.name not in manager.all_tasks:
                raise UserError(f"evaluation.benchmarks.tasks[{i}].name: lm-eval has no task {quoted(task.name)}"
                                f"{did_you_mean(task.name, manager.all_tasks)}; give a task lm-eval knows "
                                "(lm_eval ls tasks) or path: <your task YAML>")
        return manager

    def _task_name(self, task: BenchmarkTask) -> str:
        if task.name is not None:
            return task.name
        path = Path(task.path).expanduser().resolve()
        for name, entry in self.task_manager.task_index.items():
            if getattr(entry, "yaml_path", None) is not None and Path(entry.yaml_path).resolve() == path:
                return name
        raise UserError(f"evaluation.benchmarks: {task.path} is not an lm-eval task YAML (it names no task:)")

    # ---- scoring ----------------------------------------------------------------------------
    def _lm(self, forward: Forward):
        return _forward_lm_class()(forward=forward, tokenizer=self.tokenizer, config=self.config,
                                   eos_token_ids=self.eos_token_ids, batch_size=self.batch_size, device=self.device,
                                   rank=self.rank, world_size=self.world_size, gather=self.gather)

    @torch.no_grad()
    def score(self, forward: Forward) -> dict[str, dict[str, Any]]:
        """{task: {"metric", "score", "stderr", "higher_is_better"}} of the model `forward` runs now,
        scored as `lm_eval.simple_evaluate` scores it (its default seeds; the run's random state
        is restored after, so that scoring changes nothing of the training that follows)."""
        from lm_eval import simple_evaluate

        started = time.perf_counter()
        lm = self._lm(forward)
        saved = _random_state()
        try:
            scores = {}
            for task, name in zip(self.tasks, self.names):
                results = simple_evaluate(model=lm, tasks=[name], num_fewshot=task.num_fewshot, limit=task.limit,
                    batch_size=self.batch_size, task_manager=self.task_manager, log_samples=False)
                # simple_evaluate returns its results only where LOCAL_RANK is 0 (rank 0 among them);
                # every rank computed the same ones from the same gathered answers: rank 0's for all.
                scores[name] = self.gather(None if results is None else _main_score(results, name))[0]
        finally:
            _set_random_state(saved)
        self.seconds += time.perf_counter() - started
        logger.info("benchmarks: %s scored in %.1f s", ", ".join(scores), time.perf_counter() - started)
        return scores

    def measure(self, forward: Forward) -> dict[str, dict[str, Any]]:
        """The live model's scores beside θ*'s and the drop from them (positive: worse than θ*)."""
        reference = self._require_reference()
        out = {}
        for name, now in self.score(forward).items():
            before = reference[name]
            sign = 1.0 if now["higher_is_better"] else -1.0
            out[name] = {"metric": now["metric"], "score": now["score"], "stderr": now["stderr"],
                         "theta_star": before["score"], "theta_star_stderr": before["stderr"],
                         "drop": sign * (before["score"] - now["score"])}
            out[name]["rate"] = is_rate(out[name])  # whether benchmark_forgetting averages its drop
        return out

    # ---- θ*'s side ----------------------------------------------------------------------------
    def reference_from_model(self, forward: Forward, keep_in: Path | None, *, is_main: bool,
                             barrier: Callable[[], None]) -> None:
        """θ*'s scores, from the model `forward` runs now (the run's before its first step), written
        into the file `keep_in` when given (collective)."""
        self.reference = self.score(forward)
        if keep_in is not None:
            self._save_reference(keep_in, is_main=is_main, barrier=barrier)

    def reference_from_run(self, saved_in: Path, keep_in: Path | None, *, is_main: bool,
                           barrier: Callable[[], None]) -> None:
        """θ*'s scores as the run's first attempt kept them in the file `saved_in`; kept in `keep_in`
        too when that is another file."""
        missing = UserError(f"{saved_in}: θ*'s benchmark scores are missing (the run scored them before its first "
                            "step); a resumed run cannot score θ* again on moved weights: start the run fresh, or "
                            "remove evaluation.benchmarks")
        try:
            saved = read_json(saved_in, entry="θ*'s benchmark scores")
        except MissingFile:
            raise missing from None
        if saved.get("version") != _REFERENCE_VERSION or saved.get("tasks") != self._identity():
            raise UserError(f"{saved_in}: θ*'s benchmark scores were taken on other tasks ({saved.get('tasks')}); "
                            "keep evaluation.benchmarks.tasks as the run started, or start fresh")
        self.reference = {name: dict(score) for name, score in saved["scores"].items()}
        if keep_in is not None and saved_in.resolve() != keep_in.resolve():
            self._save_reference(keep_in, is_main=is_main, barrier=barrier)

    def keeps_reference(self, file: Path) -> bool:
        return file.is_file()

    def _identity(self) -> list[dict[str, Any]]:
        return [{**t.identity(), "task": name} for t, name in zip(self.tasks, self.names)]

    def _save_reference(self, file: Path, *, is_main: bool, barrier: Callable[[], None]) -> None:
        if is_main:
            file.parent.mkdir(parents=True, exist_ok=True)
            partial = file.with_name(file.name + ".partial")
            partial.write_text(json.dumps({"version": _REFERENCE_VERSION, "tasks": self._identity(),
                                           "scores": self._require_reference()}, indent=1, allow_nan=True))
            partial.replace(file)
        barrier()

    def _require_reference(self) -> dict[str, dict[str, Any]]:
        if self.reference is None:
            raise RuntimeError("the benchmarks have no θ* scores: reference_from_model() or reference_from_run() first")
        return self.reference

    def describe(self) -> dict[str, Any]:
        """What results.json says about the benchmarks besides their scores."""
        return {"tasks": self._identity(), "seconds": round(self.seconds, 3),
                "reference": "the run's model before its first step"}


def _main_score(results: dict[str, Any], name: str) -> dict[str, Any]:
    """The task's first metric (its metric_list's first, lm-eval's first filter) and its stderr."""
    row = results["results"][name]
    for key, value in row.items():
        if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
            continue
        metric = key.split(",")[0]
        stderr = row.get(key.replace(",", "_stderr,", 1))
        higher = results.get("higher_is_better", {}).get(name, {}).get(metric, True)
        return {"metric": key, "score": float(value),
                "stderr": float(stderr) if isinstance(stderr, (int, float)) else None,
                "higher_is_better": bool(True if higher is None else higher)}
    raise UserError(f"evaluation.benchmarks: lm-eval's results for {name} hold no score ({sorted(row)})")


def _random_state() -> tuple[Any, ...]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_random_state(state: tuple[Any, ...]) -> None:
    python, numpy_state, torch_state, cuda = state
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch_state)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
