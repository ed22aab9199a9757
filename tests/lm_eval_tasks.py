"""Small lm-evaluation-harness tasks the tests write into a directory: a multiple-choice one (scored
by loglikelihood) and a generative one (generate_until with a stop sequence), each over a handful
of JSON-lines rows, read from that directory without the hub.

    mc_yaml, gen_yaml = write_lm_eval_tasks(tmp_path / "tasks")
"""

from __future__ import annotations

import json
from pathlib import Path

MC_TASK = "tiny_choice"
GEN_TASK = "tiny_reverse"
ROLLING_TASK = "tiny_text"

_WORDS = ["cat", "dog", "sun", "tree", "blue", "red", "fish", "bird", "moon", "stone", "river"]


def write_lm_eval_tasks(directory: Path, *, rows: int = 7) -> tuple[Path, Path, Path]:
    """(the multiple-choice task's YAML, the generative task's, the rolling-perplexity task's) in
    `directory`; rows of several lengths, so that batches pad and ranks' shares differ. The
    generative task's prompts are tiny_llm.write_sft_rows' (a run trained on them answers them)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    choice_rows, reverse_rows = [], []
    for i in range(rows):
        picked = [_WORDS[(3 * i + k) % len(_WORDS)] for k in range(2 + i % 3)]  # distinct: no tied choices
        choices = [" ".join(picked[::-1]), " ".join(picked), " ".join(reversed(picked[1:] + ["sky"])) + " x" * (i % 3)]
        choice_rows.append({"question": "Reverse: " + " ".join(picked), "choices": choices, "label": i % 3})
        reverse_rows.append({"question": "Reverse: " + " ".join(picked) + "\n", "answer": " ".join(picked[::-1])})
    (directory / "choice.jsonl").write_text("".join(json.dumps(r) + "\n" for r in choice_rows))
    (directory / "reverse.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reverse_rows))
    mc = directory / f"{MC_TASK}.yaml"
    mc.write_text(f"""task: {MC_TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {directory / 'choice.jsonl'}
test_split: test
fewshot_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""")
    gen = directory / f"{GEN_TASK}.yaml"
    gen.write_text(f"""task: {GEN_TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {directory / 'reverse.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    text = directory / f"{ROLLING_TASK}.yaml"
    text.write_text(f"""task: {ROLLING_TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {directory / 'reverse.jsonl'}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{question}}}}{{{{answer}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""")
    return mc, gen, text
