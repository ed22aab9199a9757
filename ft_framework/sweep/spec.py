"""Schema of a sweep file: a base run config, the axes of the grid, the methods compared, the
runner and where results go.

    # configs/sweeps/example.yaml
    base: ../quickstart.yaml          # a run config (relative to this file) or an inline mapping
    output_dir: runs/sweeps/example   # the results store (relative to the current directory)
    set: {training.max_steps: 100}    # keys set in every run
    axes:                             # shared by every method; dotted config key -> values
      data.task: [rte, mrpc]
      training.seed: [1, 2, 3]
    methods:                          # optional; each is a bundle of keys plus its own axes
      recadam:
        set: {optimizer.name: recadam, model.init: random}
        axes: {optimizer.hparams.anneal_k: [0.1, 1.0]}
      vanilla:
        base: ../albert_xxl_adam.yaml # a method may start from another run config
    runner: {name: local, max_parallel: 2}

A method written as a flat mapping of keys (``vanilla: {optimizer.name: adamw}``) means ``set:``.
Axis names (not `set` keys) ``task``, ``seed`` and ``optimizer`` are shorthands for
``data.task``, ``training.seed`` and ``optimizer.name``. A value replaces the whole key it names (a mapping
given for ``optimizer.hparams`` replaces the base's hparams, it is not merged), and values set by
the sweep win over the base config's ``task_overrides``.
"""

from __future__ import annotations

from copy import deepcopy
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ft_framework.config import ConfigError, read_yaml
from ft_framework.config.schema import InterpolationConfig

__all__ = ["AXIS_ALIASES", "RunnerSpec", "MethodSpec", "ReportSpec", "SweepSpec", "load_sweep",
           "validate_sweep", "canonical_key"]

# Short axis names and the config keys they stand for.
AXIS_ALIASES: dict[str, str] = {"task": "data.task", "seed": "training.seed", "optimizer": "optimizer.name"}

_METHOD_KEYS = ("base", "set", "axes")


def canonical_key(key: str) -> str:
    """The dotted config key an axis / set key names (aliases resolved)."""
    key = str(key).strip()
    return AXIS_ALIASES.get(key, key)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")


def _check_axes(axes: dict[str, Any]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for key, values in axes.items():
        name = canonical_key(key)
        if not name or any(not p for p in name.split(".")):
            raise ValueError(f"axis {key!r} must be a dotted config key such as training.seed")
        if name in out:
            raise ValueError(f"axis {key!r} is given twice (as {name!r})")
        if not isinstance(values, list) or not values:
            raise ValueError(f"axis {key!r} must be a non-empty list of values, got {values!r}")
        seen = []
        for v in values:
            if v in seen:
                raise ValueError(f"axis {key!r} lists the value {v!r} twice")
            seen.append(v)
        out[name] = list(values)
    return out


def _check_set(values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = str(key).strip()
        if not name or any(not p for p in name.split(".")):
            raise ValueError(f"key {key!r} must be a dotted config key such as optimizer.name")
        out[name] = value
    return out


class RunnerSpec(_Strict):
    """Where and how the runs execute."""

    # local: subprocesses on this machine; ray: tasks on a Ray cluster (or a local Ray instance);
    # slurm: one batch job per run (sweep/slurm_runner.py).
    name: Literal["local", "ray", "slurm"] = "local"
    # local runner: runs at a time (each gets num_gpus_per_run GPUs of its own when GPUs are asked for);
    # slurm runner: jobs in the queue at once.
    max_parallel: int = Field(1, gt=0)
    # ray runner: cluster address ("auto", "ray://host:10001", ...); None or "local" starts a local instance.
    address: str | None = None
    # Resources each run asks for: Ray schedules by them; both runners give the run that many CPU
    # threads (OMP_NUM_THREADS) and GPUs of its own. None: 1 CPU on Ray, the machine's cores
    # divided by max_parallel on the local runner.
    num_cpus_per_run: float | None = Field(None, gt=0)
    num_gpus_per_run: int = Field(0, ge=0)
    # How a run's process is started. auto: plain python for strategy single, torchrun for
    # ddp / fsdp / deepspeed (torchrun keeps the CUDA_VISIBLE_DEVICES a runner assigned).
    launcher: Literal["auto", "python", "torchrun", "deepspeed"] = "auto"
    # Processes of a multi-process run; None: num_gpus_per_run (at least 1). slurm runner: per node.
    procs_per_run: int | None = Field(None, gt=0)
    # slurm runner only (docs/multinode.md): the job's partition and time limit (sbatch --time, e.g.
    # "04:00:00"; None: the partition's), nodes per run (more than one: the run's processes are srun's
    # tasks), extra "#SBATCH ..." lines, how many seconds before the time limit the run is sent
    # SIGUSR1 to save a checkpoint, whether a run stopped by SIGUSR1 requeues its own job (else it ends
    # interrupted and the sweep submits it again), and how often the queue is read.
    partition: str | None = None
    time: str | None = None
    nodes_per_run: int = Field(1, gt=0)
    sbatch_lines: list[str] = Field(default_factory=list)
    signal_before_end_s: int | None = Field(90, gt=0)
    requeue: bool = False
    poll_s: float = Field(5.0, gt=0)

    @model_validator(mode="after")
    def _slurm_keys_need_slurm(self) -> "RunnerSpec":
        if self.name != "slurm":
            for key in ("partition", "time", "sbatch_lines"):
                if getattr(self, key):
                    raise ValueError(f"runner.{key} applies to the slurm runner only (runner.name: slurm)")
            if self.nodes_per_run != 1 or self.requeue:
                raise ValueError("runner.nodes_per_run and runner.requeue apply to the slurm runner only "
                                 "(runner.name: slurm)")
        for line in self.sbatch_lines:
            if not line.startswith("#SBATCH ") or "\n" in line:
                raise ValueError(f"runner.sbatch_lines: {line!r} must be one line starting with '#SBATCH '")
        return self


class _SetAndAxesChecks(_Strict):
    """The checks of `set` and `axes`, shared by a sweep and each of its methods. Only validators:
    each class declares the fields itself, so error messages list its keys in its own order."""

    @field_validator("axes", check_fields=False)
    @classmethod
    def _axes(cls, value: dict[str, Any]) -> dict[str, list[Any]]:
        return _check_axes(value)

    @field_validator("set", check_fields=False)
    @classmethod
    def _set(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _check_set(value)


class MethodSpec(_SetAndAxesChecks):
    """A method of the comparison: a bundle of config keys, optionally its own base and axes."""

    base: str | dict[str, Any] | None = None
    set: dict[str, Any] = Field(default_factory=dict)
    axes: dict[str, list[Any]] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _flat_form(cls, data: Any) -> Any:
        if data is None:
            return {}
        if isinstance(data, dict):
            extra = {k: v for k, v in data.items() if k not in _METHOD_KEYS}
            if extra:
                data = {k: v for k, v in data.items() if k in _METHOD_KEYS}
                data["set"] = {**(data.get("set") or {}), **extra}
        return data


class ReportSpec(_Strict):
    """How ft-report reads the runs."""

    # Axes that are random seeds: runs differing only in these are repeats of one setting.
    seed_keys: list[str] = Field(default_factory=lambda: ["training.seed", "training.data_seed"])


# The sweep's `interpolate:` post-step is a run's evaluation.interpolation, which the sweep gives to every
# run (ft_framework/sweep/postprocess.py): one schema, owned by the run config.
InterpolateSpec = InterpolationConfig


class SweepSpec(_SetAndAxesChecks):
    """A grid of runs: base config x axes (x methods)."""

    name: str | None = None
    base: str | dict[str, Any]
    # Config keys set in every run (dotted key -> value), over the base config.
    set: dict[str, Any] = Field(default_factory=dict)
    axes: dict[str, list[Any]] = Field(default_factory=dict)
    methods: dict[str, MethodSpec] | None = None
    runner: RunnerSpec = Field(default_factory=RunnerSpec)
    output_dir: str = "runs/sweep"
    report: ReportSpec = Field(default_factory=ReportSpec)
    # Post-step: interpolate every finished run toward θ* (WiSE-FT); None: none.
    interpolate: InterpolateSpec | None = None
    # Directory relative `base` paths are read from (the sweep file's); not part of the YAML.
    source_dir: str | None = Field(None, exclude=True)

    @field_validator("methods")
    @classmethod
    def _methods(cls, value: dict[str, MethodSpec] | None) -> dict[str, MethodSpec] | None:
        if value is not None and not value:
            raise ValueError("methods must name at least one method (or leave methods out)")
        for name in value or {}:
            if not str(name) or "/" in str(name):
                raise ValueError(f"method name {name!r} must be a non-empty name without '/'")
        return value

    @model_validator(mode="after")
    def _no_axis_in_two_places(self) -> "SweepSpec":
        clash = sorted(set(self.set) & set(self.axes))
        if clash:
            raise ValueError(f"set fixes {clash[0]!r}, which is also an axis; keep it in one place")
        for name, method in (self.methods or {}).items():
            if set(method.axes) & set(method.set):
                raise ValueError(f"methods.{name} both sets and varies {sorted(set(method.axes) & set(method.set))[0]!r}")
            both = sorted(set(method.axes) & set(self.axes))
            if both:
                raise ValueError(f"methods.{name}.axes repeats the shared axis {both[0]!r}; keep it in one place")
            clash = sorted(set(method.set) & set(self.axes))
            if clash:
                raise ValueError(f"methods.{name}.set fixes {clash[0]!r}, which is also a shared axis")
        return self

    def resolve_path(self, path: str) -> Path:
        """A path from the sweep file (base configs), relative to the file's directory."""
        p = Path(path)
        if not p.is_absolute() and self.source_dir is not None:
            p = Path(self.source_dir) / p
        return p

    def base_data(self, method: str | None = None) -> dict[str, Any]:
        """The raw run-config mapping a method starts from (its own base, else the sweep's)."""
        base = self.base
        if method is not None and self.methods and self.methods[method].base is not None:
            base = self.methods[method].base
        if isinstance(base, dict):
            return deepcopy(base)
        return read_yaml(self.resolve_path(base))


def _valid_keys(loc: tuple[Any, ...]) -> list[str] | None:
    """The keys valid where an unknown key `loc` was found."""
    where = {(): SweepSpec, ("runner",): RunnerSpec, ("report",): ReportSpec, ("interpolate",): InterpolateSpec}.get(tuple(loc[:-1]))
    if where is None:
        return None
    return [k for k in where.model_fields if k != "source_dir"]


def _format_error(err: ValidationError, where: str) -> str:
    lines = [f"invalid sweep{f' {where}' if where else ''}:"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            valid = _valid_keys(e["loc"])
            msg = "unknown key" + (f"; valid keys here: {', '.join(valid)}" if valid else "")
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif "input" in e and not isinstance(e["input"], dict):
            msg = f"{msg} (got {e['input']!r})"
        lines.append(f"  {path}: {msg}")
    return "\n".join(lines)


def validate_sweep(data: dict[str, Any], *, source_dir: str | Path | None = None, where: str = "") -> SweepSpec:
    """A SweepSpec from a raw mapping; errors are ConfigError naming the key."""
    if not isinstance(data, dict):
        raise ConfigError(f"a sweep file must be a mapping, got {type(data).__name__}")
    try:
        spec = SweepSpec.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e, where)) from None
    if source_dir is not None:
        spec.source_dir = str(source_dir)
    return spec


def load_sweep(path: str | Path) -> SweepSpec:
    """Reads and validates a sweep file; relative `base` paths are read from the file's directory."""
    path = Path(path)
    return validate_sweep(read_yaml(path), source_dir=path.resolve().parent, where=f"({path})")
