"""Supervised fine-tuning of a decoder LM (data.problem: causal_lm): the pretrained causal LM as it
is (AutoModelForCausalLM: every weight has a θ*, tied embeddings once), the SFT rows of data/sft.py
padded or packed into batches, the next-token loss on the completion tokens (the label tokens),
averaged over every label token of the optimizer step on every rank, and its metrics:

- completion_loss: the mean next-token loss over the evaluation split's completion tokens, and its
  perplexity exp(completion_loss);
- exact_match (data.main_metric: exact_match): the fraction of rows whose greedy completion equals
  the reference token for token, end-of-sequence token included (read from the same forward as the
  loss: greedy_matches);
- a few greedy generations for the selection split's first prompts (evaluation.generation), and
- forgetting on held-out text (models/lm_forgetting.py): the LM loss gained, the KL from θ*, the
  CKA drift.

A run is judged against the pretrained model itself: it is evaluated before the first step.
"""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from ft_framework import resources
from ft_framework.config.schema import IMPORTANCE_PROBE_SOURCE, general_text_path
from ft_framework.data.hub_tables import HubSplit, open_hub_split
from ft_framework.data.replay import ReplayMix
from ft_framework.data.general_text import REPLAY_KEY, load_replay, text_table
from ft_framework.data.readers import Table
from ft_framework.data.sft import (DEFAULT_CACHE_DIR, TRAIN, SFTCollator, SFTSettings, attention_windows,
                                   load_sft_data, load_text_rows)
from ft_framework.data.token_cache import content_hash
from ft_framework.data.sft_collate import IGNORE_INDEX, packed_attention_mask
from ft_framework.data.sft_tokenize import check_chat_template
from ft_framework.data.sharding import eval_shard
from ft_framework.errors import MissingPath, UserError
from ft_framework.models.lm_benchmarks import BenchmarkSuite, BenchmarkTask
from ft_framework.models.lm_forgetting import LMForgettingProbe, lm_probe_reference_bytes
from ft_framework.models.kl_anchor import KLAnchor, anchor_batch_bytes, anchor_targets
from ft_framework.models.lm_head_requests import (REQUEST_KEY, NextTokenLoss, anchor_head_bytes, anchor_kl,
                                                  anchor_kl_bytes, label_rows)
from ft_framework.models.loading import CAUSAL_LM_CLASS, ModelClass
from ft_framework.models.probes import build_probe, probe_text
from ft_framework.task_kinds.base import (Baseline, EvalContext, LossNormalizer, MemoryRow, MicroBatchLoss, RunContext,
                                         TaskKind, TraceBatch, combined_content, to_device)
from ft_framework.user_files import read_text

logger = logging.getLogger(__name__)

__all__ = ["CausalLMKind", "greedy_completions", "greedy_matches",
           "label_token_count",
           "next_token_losses"]

# Keys of a collated batch that the model's forward takes (the labels stay with the loss).
_MODEL_KEYS = ("input_ids", "attention_mask", "position_ids")


def next_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the summed next-token cross-entropy of the label tokens, their count): position t predicts
    label t+1; IGNORE_INDEX labels count nothing. In fp32 whatever the logits' dtype."""
    # The labels move, not the logits: slicing off the last position would copy the whole
    # (batch, length, vocab) logits (200 MB for 4 x 256 tokens of a 49k vocabulary) and backward
    # another; the last position's label is IGNORE_INDEX instead, and counts nothing.
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    total = F.cross_entropy(logits.float().flatten(0, 1), shifted.flatten(), ignore_index=IGNORE_INDEX,
                            reduction="sum")
    return total, int((shifted != IGNORE_INDEX).sum())


def label_token_count(batch: dict[str, torch.Tensor]) -> int:
    """The tokens whose prediction the loss counts in a collated batch."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def greedy_matches(logits: torch.Tensor, input_ids: Sequence[int], prompt_length: int, completion_length: int) -> bool:
    """Whether greedy decoding after the row's prompt writes its completion, read from one forward
    over prompt + completion (`logits`: that row's, (T, vocab)). Greedy decoding writes token k of
    the completion when the model's most likely token after the prompt and the completion's first k
    tokens is it; as long as every earlier token matched, that context is exactly the reference's,
    so the completion is written iff the argmax at every completion position is the reference's
    next token (its end-of-sequence token included): the same answer as decoding, in one pass."""
    positions = slice(prompt_length - 1, prompt_length + completion_length - 1)
    reference = torch.as_tensor(list(input_ids[prompt_length:prompt_length + completion_length]),
                                device=logits.device)
    return bool(torch.equal(logits[positions].argmax(-1), reference))


@torch.no_grad()
def greedy_completions(forward: Callable[[dict[str, Any]], Any], prompts: Sequence[Sequence[int]],
                       max_new_tokens: int, pad_id: int, device: torch.device) -> list[list[int]]:
    """`max_new_tokens` greedy tokens after each prompt, for a batch of prompts (left-padded, with the
    model's cache). Every call makes exactly `max_new_tokens` forwards whatever the model answers, so
    that ranks of a sharded model stay in step (each forward is collective there)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        if len(prompt):
            input_ids[i, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
            attention[i, width - len(prompt):] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    out = forward({"input_ids": input_ids, "attention_mask": attention, "position_ids": positions, "use_cache": True})
    # transformers 5 names the model's cache `cache` (its outputs say so), earlier ones `past_key_values`.
    cache_key = "cache" if "cache" in out.keys() else "past_key_values"
    token = out.logits[:, -1].argmax(-1)
    generated = [token]
    last = positions[:, -1:]
    for step in range(1, max_new_tokens):
        attention = torch.cat([attention, attention.new_ones((len(prompts), 1))], dim=1)
        out = forward({"input_ids": token[:, None], "attention_mask": attention, "position_ids": last + step,
                       cache_key: out[cache_key], "use_cache": True})
        token = out.logits[:, -1].argmax(-1)
        generated.append(token)
    return torch.stack(generated, dim=1).cpu().tolist()


class CausalLMKind(TaskKind):
    name = "causal_lm"

    @property
    def model_class(self) -> ModelClass:
        return ModelClass(CAUSAL_LM_CLASS, new_head=False)

    # ---- data --------------------------------------------------------------------------------
    def _files(self) -> dict[str, Path | HubSplit]:
        data = self.cfg.data
        if data.files is not None:
            return {split: Path(path).expanduser() for split, path in data.files.items()}
        hub = data.hub_source()
        if hub is not None:
            return {split: open_hub_split(hub, split) for split in hub.splits}
        folder = resources.quickstart_sft_dir()  # the one shipped SFT set (schema.BUILTIN_DATA_SOURCES)
        return {split: folder / f"{split}.jsonl" for split in ("train", "validation")}

    def _chat_template(self) -> str | None:
        path = self.cfg.data.chat_template
        if path is None:
            return None
        file = Path(path).expanduser()
        if not file.exists():
            raise MissingPath(f"data.chat_template: {path} is not a file; give a Jinja chat template file, or null "
                              "for the tokenizer's own template")
        try:
            template = read_text(file, entry="data.chat_template")
        except UserError as exc:
            raise UserError(f"data.chat_template: {exc}") from None
        check_chat_template(template, f"data.chat_template: {path}")  # before any row is read
        return template

    def _token_cache_dir(self) -> Path:
        """data.token_cache_dir, or the default: where the rows' tokens and the KL anchor's targets go."""
        cache = self.cfg.data.token_cache_dir
        return Path(cache).expanduser() if cache else DEFAULT_CACHE_DIR.expanduser()

    def load_data(self, tokenizer: Any, run: RunContext) -> Any:
        data = self.cfg.data
        settings = SFTSettings(max_seq_length=data.max_seq_length, train_on_prompt=data.train_on_prompt,
                               chat_template=self._chat_template(), packing=data.packing)
        cache = self._token_cache_dir()
        loaded = load_sft_data(self._files(), tokenizer, settings, cache_dir=cache, is_main=run.is_main,
                               barrier=run.barrier, max_train_examples=data.max_train_examples,
                               max_eval_examples=data.max_eval_examples, progress=run.progress)
        if data.replay is not None:
            loaded.replay = self._load_replay(tokenizer, run, cache)
        self.pad_id = _pad_id(tokenizer)
        self.tokenizer = tokenizer
        if "exact_match" in self.spec.metrics:
            for split, dataset in loaded.eval.items():
                if (dataset.prompt_lengths == 0).any():
                    raise UserError(f"data.main_metric: exact_match scores greedy completions of a prompt, and the "
                                    f"{split} split has rows without one (text rows); give prompt/completion or "
                                    "messages rows, or set data.main_metric: completion_loss")
        return loaded

    def collator(self, tokenizer: Any, model_config: Any) -> Callable:
        # Packed rows attend within themselves: transformers finds each row's bounds from the
        # position_ids when a batch has no mask (and applies sliding windows itself); eager attention
        # takes the dense 4D mask instead, which carries the windows of the models whose layers slide
        # (the model applies none to a mask it is given).
        dense = _dense_packed_mask(getattr(model_config, "_attn_implementation", None))
        if self.cfg.data.packing and dense:
            logger.info("packed batches carry a dense (B, 1, T, T) mask: attention %r takes no sequence bounds "
                        "from position_ids (model.attn_implementation: sdpa, flex_attention or flash_attention_2 "
                        "need none)", model_config._attn_implementation)
        return SFTCollator(_pad_id(tokenizer), attention_windows=attention_windows(model_config),
                           dense_packed_mask=dense)

    def _load_replay(self, tokenizer: Any, run: RunContext, cache: Path) -> ReplayMix:
        """data.replay's rows, drawn per step among the run's task rows (data/replay.py), said at start."""
        replay, training = self.cfg.data.replay, self.cfg.training
        task_rows = training.per_device_batch_size * run.world_size * training.gradient_accumulation_steps
        mix = load_replay(general_text_path(replay.file), replay.fraction, tokenizer, self.cfg.data.max_seq_length,
                          task_rows_per_step=task_rows, seed=training.data_seed, cache_dir=cache, is_main=run.is_main,
                          barrier=run.barrier, progress=run.progress)
        if run.is_main:
            logger.info("replay: %d rows of general text join the %d task rows of every optimizer step (fraction %g "
                        "asked, %.3f taken), drawn from %s (%d rows, sha256 %s), the LM loss on all their tokens",
                        mix.rows_per_step, task_rows, replay.fraction,
                        mix.rows_per_step / (mix.rows_per_step + task_rows), mix.source["file"],
                        mix.source["rows_in_file"], mix.source["sha256"][:16])
        return mix

    def describe_data(self, data: Any) -> dict[str, Any]:
        return {"sft": data.stats}

    def data_content(self, data: Any) -> dict[str, str]:
        # Every split's and the replay file's id is its token cache key's source: hashed once, when read.
        splits = {TRAIN: data.train.rows.cache_key["source"],
                  **{split: rows.cache_key["source"] for split, rows in data.eval.items()}}
        source = self.cfg.data
        if source.files is not None:
            ids = {f"data.files.{split}": content for split, content in splits.items()}
        else:  # a Hub data set's splits, or the shipped set's, under the one key that names them
            ids = {"data.hub_id" if source.hub_source() is not None else "data.source": combined_content(splits)}
        if data.replay is not None:
            ids[REPLAY_KEY] = data.replay.rows.cache_key["source"]
        return {**self.probe_content(), **ids, **getattr(self, "_importance_content", {})}

    def build_kl_anchor(self, model: Any, data: Any) -> KLAnchor | None:
        loss = self.cfg.loss
        if not loss.kl_to_pretrained:
            return None
        return KLAnchor(loss.kl_to_pretrained, loss.kl_top_k, model=model, train_key=data.train.rows.cache_key,
                        cache_dir=self._token_cache_dir(),
                        forward_settings={"precision": self.cfg.training.precision,
                                          "attn_implementation": self.cfg.model.attn_implementation})

    def replay(self, data: Any) -> ReplayMix | None:
        return data.replay

    # ---- loss ----------------------------------------------------------------------------------
    def model_inputs(self, batch: dict[str, torch.Tensor], *, per_token: bool = False) -> dict[str, Any]:
        # No key/value cache outside generation: it would hold every layer's keys for nothing, and a
        # block recomputed by activation checkpointing would append its keys to it a second time.
        inputs = {**{k: v for k, v in batch.items() if k in _MODEL_KEYS}, "use_cache": False}
        if self.cfg.training.chunked_loss:
            # The model's head answers the loss itself, a chunk of label tokens at a time
            # (models/lm_head_requests.py): the output's logits are that answer.
            inputs[REQUEST_KEY] = NextTokenLoss(batch["labels"], per_token=per_token,
                                                anchor=None if per_token else anchor_targets(batch))
        return inputs

    def step_units(self, batches: Sequence[dict[str, torch.Tensor]]) -> float | None:
        return float(sum(label_token_count(b) for b in batches))

    def loss(self, outputs: Any, batch: dict[str, torch.Tensor], normalizer: LossNormalizer) -> MicroBatchLoss:
        anchor = anchor_targets(batch)  # training batches of a run with loss.kl_to_pretrained (else None)
        kl = None
        if self.cfg.training.chunked_loss:  # the head's answer to model_inputs' request: the summed loss
            total, count = outputs.logits, label_token_count(batch)
            if anchor is not None:  # ... and the summed KL to θ*'s stored distributions
                total, kl = total[0], total[1]
        else:
            labels = batch["labels"].to(outputs.logits.device)
            total, count = next_token_losses(outputs.logits, labels)
            if anchor is not None:
                kl = anchor_kl(label_rows(outputs.logits, labels), anchor.to(outputs.logits.device))
        objective = total if kl is None else total + self.cfg.loss.kl_to_pretrained * kl
        # The data-parallel strategies average the ranks' gradients: a rank's token sum over the
        # step's tokens on every rank, times the ranks, is the step's token mean once averaged.
        return MicroBatchLoss(objective * (normalizer.world_size / normalizer.step_units), float(total.detach()),
                              float(count), {} if kl is None else {"kl_to_pretrained": float(kl.detach())})

    # ---- metrics -------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, data: Any, ctx: EvalContext) -> dict[str, dict[str, Any]]:
        exact = "exact_match" in self.spec.metrics
        out = {}
        for split, dataset in data.eval.items():
            shard = eval_shard(len(dataset), ctx.rank, ctx.world_size)
            total, count, hits = 0.0, 0, 0
            rows = [dataset[i] for i in shard.padded]
            for start in range(0, len(rows), ctx.batch_size):
                chunk = rows[start:start + ctx.batch_size]
                real = max(0, min(shard.num_real - start, len(chunk)))
                batch = ctx.collate([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in chunk])
                logits = ctx.forward(to_device(self.model_inputs(batch, per_token=True), ctx.device)).logits
                if real and self.cfg.training.chunked_loss:
                    s, n, h = _scored_rows(logits, batch["labels"], chunk[:real], exact)
                    total, count, hits = total + s, count + n, hits + h
                elif real:
                    s, n = next_token_losses(logits[:real], batch["labels"][:real].to(logits.device))
                    total, count = total + float(s), count + n
                    if exact:
                        hits += sum(greedy_matches(logits[r], row["input_ids"], row["prompt_length"],
                                                   row["completion_length"]) for r, row in enumerate(chunk[:real]))
            sums = ctx.gather((total, count, hits))
            loss = sum(s[0] for s in sums) / max(1, sum(s[1] for s in sums))
            metrics = {"completion_loss": loss, "perplexity": math.exp(min(loss, 700.0))}
            if exact:
                metrics["exact_match"] = sum(s[2] for s in sums) / len(dataset)
            out[split] = {name: metrics[name] for name in self.spec.metrics}
        return out

    def baseline(self, data: Any, evaluate: Callable[[], dict[str, dict[str, Any]]]) -> Baseline:
        return Baseline("pretrained model", evaluate())

    @torch.no_grad()
    def samples(self, data: Any, ctx: EvalContext) -> list[dict[str, Any]] | None:
        """Greedy answers to the selection split's first prompts: every rank generates the same ones
        (a sharded model's forwards are collective)."""
        wanted = self.cfg.evaluation.generation.samples
        dataset = data.eval[self.spec.eval_splits[0]]
        rows = [dataset[i] for i in range(min(wanted, len(dataset)))]
        rows = [r for r in rows if r["prompt_length"] > 0]
        if not rows:
            return None
        answers = greedy_completions(ctx.forward, [r["input_ids"][:r["prompt_length"]] for r in rows],
                                     self.cfg.evaluation.generation.max_new_tokens, self.pad_id, ctx.device)
        eos = self.tokenizer.eos_token_id
        out = []
        for row, answer in zip(rows, answers):
            cut = answer.index(eos) if eos in answer else len(answer)
            end = row["prompt_length"] + row["completion_length"]
            out.append({"prompt": self.tokenizer.decode(row["input_ids"][:row["prompt_length"]]),
                        "reference": self.tokenizer.decode(row["input_ids"][row["prompt_length"]:end],
                                                           skip_special_tokens=True),
                        "generated": self.tokenizer.decode(answer[:cut], skip_special_tokens=True)})
        return out

    def general_text(self, tokenizer: Any, run: RunContext) -> Any:
        """optimizer.importance's text as text rows (every token but the first a label), through the
        token cache: the forgetting probe's sentences (source: probe) or a file's documents, cut to
        max_tokens."""
        importance = self.cfg.optimizer.importance
        cache = Path(self.cfg.data.token_cache_dir or DEFAULT_CACHE_DIR).expanduser()
        if importance.source == IMPORTANCE_PROBE_SOURCE:
            sentences, source = probe_text(self.cfg.evaluation.forgetting)
            name = f"optimizer.importance.source: probe ({source})"
            fingerprint = hashlib.sha256("\n".join(sentences).encode()).hexdigest()
            table = lambda: Table(None, name, ((f"{name}, sentence {i + 1}", {"text": text})  # noqa: E731
                                               for i, text in enumerate(sentences)))
        else:
            path = general_text_path(importance.source)
            if path.is_dir() or not path.exists():
                raise UserError(f"optimizer.importance.source: {path} is not a file; give a .txt file (one document a "
                                "line) or a .jsonl file (a text field), or probe")
            name = f"optimizer.importance.source: {path}"
            fingerprint = content_hash([path])
            table = lambda: text_table(path, name)  # noqa: E731
        rows, _stats = load_text_rows(name, fingerprint, table, tokenizer, importance.max_tokens, split="importance",
                                      cache_dir=cache, is_main=run.is_main, barrier=run.barrier, progress=run.progress)
        self._importance_content = {"optimizer.importance.source": fingerprint}  # data_content's, once read
        return rows

    # ---- forgetting ----------------------------------------------------------------------------
    def build_probe(self, tokenizer: Any, run: RunContext) -> LMForgettingProbe | None:
        return build_probe(LMForgettingProbe, self.cfg.evaluation.forgetting, tokenizer=tokenizer,
                           batch_size=self.cfg.evaluation.batch_size, rank=run.rank, world_size=run.world_size,
                           device=run.device, gather=run.gather, chunked=self.cfg.training.chunked_loss)

    def build_benchmarks(self, tokenizer: Any, model: Any, run: RunContext) -> BenchmarkSuite | None:
        bench = self.cfg.evaluation.benchmarks
        if not bench.tasks:
            return None
        tasks = [BenchmarkTask(name=t.name, path=t.path, limit=t.limit, num_fewshot=t.num_fewshot) for t in bench.tasks]
        return BenchmarkSuite(tasks, tokenizer=tokenizer, model=model, batch_size=bench.batch_size, rank=run.rank,
                              world_size=run.world_size, device=run.device, gather=run.gather)

    # ---- the memory plan -----------------------------------------------------------------------
    def trace_batch(self, arch: Any, *, batch_size: int, seq_len: int, device: str) -> TraceBatch:
        """(B, T) labels, positions, no cache, and the next-token loss as the run computes it: with
        training.chunked_loss the head's own, every position a label token (the most it computes);
        without it outside the model in fp32 (its copy of the logits, B x T x vocabulary, is then a
        decoder's largest activation). Every row is full length and unpadded, so the model takes no
        mask (transformers lets scaled-dot-product attention apply causality itself, as for a mask of
        all ones; packed rows carry only their position ids), except packed rows under eager
        attention, which carry the (B, 1, T, T) mask that data/sft_collate.py makes."""
        shape = (batch_size, seq_len)
        labels = torch.randint(0, arch.vocab_size, shape, device=device)
        inputs = {"input_ids": torch.randint(0, arch.vocab_size, shape, device=device),
                  "position_ids": torch.arange(seq_len, device=device).expand(shape), "use_cache": False}
        if self.cfg.data.packing and _dense_packed_mask(self.cfg.model.attn_implementation):
            segments = torch.zeros(shape, dtype=torch.long, device=device)  # one packed sequence per row here
            windows = attention_windows(arch)
            inputs["attention_mask"] = ({kind: packed_attention_mask(segments, window) for kind, window in windows.items()}
                                        if isinstance(windows, dict) else packed_attention_mask(segments, windows))
        if self.cfg.training.chunked_loss:  # every position a label token: the most the head computes
            inputs[REQUEST_KEY] = NextTokenLoss(labels, every_position=True)
            return TraceBatch(inputs, lambda out: out.logits)
        return TraceBatch(inputs, lambda out: next_token_losses(out.logits, labels)[0])

    def trace_settings(self) -> tuple[Any, ...]:
        return (self.cfg.data.packing, self.cfg.training.chunked_loss, self.cfg.model.attn_implementation)

    def memory_rows(self, arch: Any, *, world_size: int) -> list[MemoryRow]:
        forgetting = self.cfg.evaluation.forgetting
        if not forgetting.enabled:
            return []
        return [MemoryRow("theta*'s answers to the forgetting probe (its log-probabilities, fp32; this rank's share)",
                          0.0, lm_probe_reference_bytes(arch, forgetting, world_size=world_size))]

    def step_rows(self, arch: Any, *, batch_size: int, seq_len: int) -> list[MemoryRow]:
        """loss.kl_to_pretrained's share of a micro-batch, every position but each row's first a label
        token (as trace_batch takes it): θ*'s stored targets in the batch and what its KL holds beyond
        the next-token loss the trace counts, in the chunked head or on the whole logits
        (models/lm_head_requests.py)."""
        loss = self.cfg.loss
        if not loss.kl_to_pretrained:
            return []
        tokens, k, vocab = batch_size * (seq_len - 1), loss.kl_top_k, arch.vocab_size
        k_here = min(k, vocab)
        rows = [MemoryRow(f"KL anchor: theta*'s top-{k_here} in the micro-batch (int32 ids, fp32 log-probabilities "
                          "and tail)", anchor_batch_bytes(tokens, k, vocab), 0.0)]
        if self.cfg.training.chunked_loss:
            kept, chunk = anchor_head_bytes(tokens, k, vocab)
            rows += [MemoryRow("KL anchor in the chunked head: ids widened to int64 and the tail's log-sum-exp, "
                               "forward to backward", kept, 0.0),
                     MemoryRow("KL anchor in the chunked head: a second fp32 chunk of logits in backward",
                               chunk, 0.0)]
        else:
            rows.append(MemoryRow("KL anchor on the whole logits: three fp32 copies of the label tokens' logits",
                                  anchor_kl_bytes(tokens, vocab), 0.0))
        return rows


def _dense_packed_mask(attn_implementation: str | None) -> bool:
    """Whether a packed batch needs the dense (B, 1, T, T) mask for `attn_implementation` (None:
    transformers' default, sdpa): only eager attention; the others take the rows' bounds from the
    position_ids (transformers' packed-sequence detection, flash attention's varlen)."""
    return attn_implementation == "eager"


def _scored_rows(scores: torch.Tensor, labels: torch.Tensor, rows: Sequence[dict[str, Any]],
                 exact: bool) -> tuple[float, int, int]:
    """(summed loss, label tokens, exact matches) of a batch's first len(rows) rows, from the head's
    per-token answer to NextTokenLoss(labels, per_token=True): (2, N), each label token's loss and
    whether the argmax is its label, in row-major order. A row's completion is written by greedy
    decoding iff the argmax at each of its completion positions is the next token (greedy_matches);
    those positions are label tokens."""
    targets = NextTokenLoss(labels).targets(torch.device("cpu"))
    keep = targets != IGNORE_INDEX
    hit = torch.zeros(keep.shape, dtype=torch.bool)
    hit[keep] = scores[1].cpu() > 0.5
    losses = torch.zeros(keep.shape, dtype=scores.dtype)
    losses[keep] = scores[0].cpu()
    real = len(rows)
    total, count = float(losses[:real].sum()), int(keep[:real].sum())
    matches = 0
    if exact:
        for r, row in enumerate(rows):
            start, end = row["prompt_length"] - 1, row["prompt_length"] + row["completion_length"] - 1
            matches += int(bool(hit[r, start:end].all() and keep[r, start:end].all()))
    return total, count, matches


def _pad_id(tokenizer: Any) -> int:
    """The padding token (never counted: attention and labels mask it), else the end-of-sequence
    token, as decoders without a padding token are padded."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise UserError("the tokenizer has neither a padding nor an end-of-sequence token; a decoder's batches need "
                        "one of them (model.tokenizer)")
    return int(pad)
