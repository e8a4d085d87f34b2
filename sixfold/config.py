"""Typed configuration: dataclasses, YAML files, dotted overrides and validation.

Everything is checked here, before any process group exists; errors name the setting to change.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import math
import os
import re
import socket
import sys
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import yaml


DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
RUNTIME = ("recompute", "loss_chunk")  # model.* settings of how a step computes, not what: its own in each run
LR_SCHEDULES = ("cosine", "linear", "constant")  # train.schedule: the learning rate's decay after warmup
MAX_TIMEOUT_S = 1_000_000  # 11.6 days: the heartbeat's deadlines stay within the platform's time_t


class ConfigError(ValueError):
    """A setting that cannot work; the message names it and what to change."""


@dataclass
class ModelConfig:
    vocab_size: int = 320
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 176
    rope_theta: float = 10000.0
    # RoPE frequencies divided by rope_factor for a longer context: none | linear (all of them) | llama3 (Llama 3.1
    # on: those of wavelength from rope_original_len / rope_low_freq up; those up to rope_original_len /
    # rope_high_freq kept; those between blended)
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_low_freq: float = 1.0
    rope_high_freq: float = 4.0
    rope_original_len: int = 8192
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 2048
    init_std: float = 0.02
    moe_experts: int = 0  # experts per MoE layer (0: dense)
    moe_top_k: int = 2
    moe_norm_topk: bool = True  # weights: the chosen k probabilities renormalised (Mixtral); false: as routed (Switch)
    moe_every: int = 1  # layers 0, n, 2n, ... are MoE
    moe_shared_expert: bool = False  # a dense SwiGLU beside the routed experts
    moe_aux_weight: float = 0.01  # load-balancing loss
    moe_z_weight: float = 0.001  # router z-loss
    recompute: str = "none"  # activations recomputed in backward: none | selective (attention core) | full
    loss_chunk: int = 0  # tokens per chunk of the fused head and loss (0: the whole micro-batch's logits at once)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def moe_layers(self) -> range:
        """The blocks whose MLP is a mixture of experts: 0, moe_every, 2 * moe_every, ... (none without experts)."""
        return range(0, self.n_layers if self.moe_experts else 0, self.moe_every)

    def num_params(self) -> int:
        d, f, v, hd = self.dim, self.ffn_dim, self.vocab_size, self.head_dim
        attn = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads) + 2 * d
        moe_layers = len(self.moe_layers)
        mlp = 3 * d * f
        ffn = moe_layers * ((self.moe_experts + self.moe_shared_expert) * mlp + d * self.moe_experts) + \
            (self.n_layers - moe_layers) * mlp
        head = 0 if self.tie_embeddings else v * d
        return v * d + self.n_layers * attn + ffn + d + head


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    sequence_parallel: bool = True
    cp_mode: str = "ring"  # ring | allgather | ulysses
    cp_zigzag: bool = True  # balanced causal work; false: contiguous chunks
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | breadth-first | zb-h1 | zb-v
    pp_virtual_stages: int = 1  # stages per pp rank (interleaved and breadth-first: 2 or more; zb-v: 2)
    zero: int = 0
    reshard_after_forward: bool | None = None  # ZeRO-3; unset: true, and false (gather once per step) with pp
    timeout_s: float = 300.0

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        parts = [f"{n}{getattr(self, n)}" for n in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
                 if getattr(self, n) > 1]
        sp = ", sequence-TP" if self.tp > 1 and self.sequence_parallel else ""
        cp = f", cp {self.cp_mode}{'' if self.cp_zigzag else ' contiguous'}" if self.cp > 1 else ""
        pp = f", {self.pp_schedule}" + (f" v={self.pp_virtual_stages}" if self.pp_virtual_stages > 1 else "") \
            if self.pp > 1 else ""
        return (" x ".join(parts) or "single process") + sp + cp + pp + (f", zero{self.zero}" if self.zero else "")

    def inert(self) -> str:
        """What to tell a user whose settings of a dimension of size 1 change nothing, or ""."""
        fields = {"sequence_parallel": "tp", "cp_mode": "cp", "cp_zigzag": "cp", "pp_schedule": "pp"}
        idle = {f: dim for f, dim in fields.items()
                if getattr(self, dim) == 1 and getattr(self, f) != getattr(ParallelConfig, f)}
        said = ", ".join(f"parallel.{f}={shown(getattr(self, f))}" for f in idle)
        dims = " and ".join(f"parallel.{dim}=1" for dim in dict.fromkeys(idle.values()))
        return f"{said}: no effect with {dims}" if idle else ""

    @property
    def reshard(self) -> bool:
        """ZeRO-3 frees a unit's weights after its forward (else they stay gathered for the step)."""
        return self.pp == 1 if self.reshard_after_forward is None else self.reshard_after_forward


@dataclass
class TrainConfig:
    steps: int = 20
    global_batch: int = 8
    micro_batches: int = 1
    seq_len: int = 64
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 2
    schedule: str = "cosine"  # one of LR_SCHEDULES (see optim.learning_rate)
    decay_steps: int = 0  # the decay's length at the end of the run; 0: every step after warmup
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 1234
    eval_every: int = 0
    eval_batches: int = 2
    precision: str = "fp32"
    grad_reduce: str = "fp32"
    reduce_each_micro_batch: bool = False  # ZeRO-2/3: reduce-scatter after every micro-batch, not only the last
    skip_nonfinite: int = 3  # steps with a NaN/Inf loss or gradient skipped in a row; the run stops at the next
    compile: bool = False  # torch.compile each block's forward
    deterministic: bool = False  # the same bits from run to run on a GPU too (determinism.py): slower kernels


@dataclass
class DataConfig:
    source: str = "stdlib"
    format: str = "auto"
    jsonl_field: str = "text"
    jsonl_prompt_field: str = ""  # a field of text before jsonl_field's whose tokens the loss does not count
    bin_dtype: str = "uint16"
    tokenizer: str = "byte"
    bpe_vocab_size: int = 2048
    val_fraction: float = 0.01
    cache_dir: str = "~/.cache/sixfold"
    max_bytes: int = 0
    document_mask: bool = False  # a token attends only to earlier tokens of its own document (model/documents.py)


@dataclass
class CheckpointConfig:
    every: int = 0
    keep: int = 2
    resume: str = ""  # a checkpoint or run directory, or "auto": this run directory's latest, if any
    init: str = ""  # the checkpoint to start from where resume finds none (resume=auto: a requeued job's first start)
    save_final: bool = True
    async_save: bool = False  # write in a background thread from a CPU copy while training goes on

    def names_checkpoint(self) -> bool:
        """Whether the run may start from a checkpoint (resume or init is set)."""
        return bool(self.resume or self.init)


FRESH_START = {"resume": "", "init": ""}  # the checkpoint.* settings of a run that starts from new weights


@dataclass
class LogConfig:
    run_dir: str = "runs/latest"
    every: int = 1
    progress: bool = True
    tensorboard: bool = True
    trace: bool = False
    sample_tokens: int = 0
    sample_prompt: str = "def "


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# settings that are paths: "~" in them is expanded
PATHS = ("data.source", "data.tokenizer", "data.cache_dir", "checkpoint.resume", "checkpoint.init", "log.run_dir")


def _fields(obj) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj)}


# other frameworks' names (Hugging Face's, Megatron's) for settings of ours
ALIASES = {"batch_size": "global_batch", "learning_rate": "lr", "gradient_accumulation_steps": "micro_batches",
           "max_steps": "steps", "seq_length": "seq_len", "max_seq_length": "seq_len", "hidden_size": "dim",
           "num_layers": "n_layers", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
           "num_key_value_heads": "n_kv_heads", "intermediate_size": "ffn_dim", "max_position_embeddings":
           "max_seq_len", "tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp",
           "context_parallel_size": "cp", "expert_model_parallel_size": "ep", "max_grad_norm": "grad_clip"}
# where ours means something else than theirs
ALIAS_NOTES = {"batch_size": "the sequences of a step over all ranks together, not per device",
               "gradient_accumulation_steps": "the parts train.global_batch is cut into; the step's batch stays "
                                              "train.global_batch, not multiplied"}


def _unknown(key: str, obj, where: str, root) -> ConfigError:
    """Names the keys it may stand for: our name for another framework's (ALIASES), the same key in another section
    of `root` (train.tp: parallel.tp), those it begins (dp: dp_replicate, dp_shard), else the closest, else (a key
    given without its section: steps, dp, max_steps) the sections' keys it begins, or for another framework's name,
    ours; a one-letter key begins none."""
    choices, ours = _fields(obj), ALIASES.get(key, key)
    others = [s for s in _fields(root) if dataclasses.is_dataclass(section := getattr(root, s)) and section is not obj]
    near = [where + ALIASES[key]] if ALIASES.get(key) in choices else \
        [f"{s}.{ours}" for s in others if where and ours in _fields(getattr(root, s))] or \
        sorted(where + c for c in choices if len(key) > 1 and c.startswith(key)) or \
        [where + c for c in difflib.get_close_matches(key, list(choices), n=1, cutoff=0.5)] or \
        sorted(f"{c}.{k}" for c in choices if dataclasses.is_dataclass(getattr(obj, c))
               for k in _fields(getattr(obj, c)) if k == ours or (len(key) > 1 and key not in ALIASES and
                                                                  k.startswith(key)))
    named = " or ".join(f"'{c}'" for c in near)
    hint = f"; did you mean {named}?" if near else f"; valid keys: {', '.join(sorted(choices))}"
    if key in ALIAS_NOTES and near and all(c.rsplit(".", 1)[-1] == ours for c in near):
        hint += f" (here: {ALIAS_NOTES[key]})"
    return ConfigError(f"unknown config key '{where}{key}'{hint}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _listed(numbers: list[int]) -> str:
    return ", ".join(map(str, numbers))


def _multiples(value: int, k: int) -> str:
    """The multiples of k either side of `value` (at least k), as a setting to choose from."""
    below = value // k * k
    return " or ".join(map(str, sorted({max(below, k), below + k})))


def _coerce(value, typ, name: str):
    if typ == bool | None:
        try:
            return None if value is None or value == "" else _coerce(value, bool, name)
        except ConfigError:
            raise ConfigError(f"{name} must be true, false or null (unset), got {value!r}") from None
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{name} must be true or false (or yes/no, on/off, 1/0), got {value!r}")
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)) or (
                isinstance(value, str) and not re.fullmatch(r"\s*[+-]?[0-9]+(?:_[0-9]+)*\s*", value)):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:  # more digits than Python converts
            raise ConfigError(f"{name} must be an integer of at most {sys.get_int_max_str_digits()} digits") from None
    if typ is float:
        if isinstance(value, bool):
            raise ConfigError(f"{name} must be a number, got {value!r}")
        if isinstance(value, str):  # YAML's spelling of infinity and NaN too
            value = re.sub(r"^([+-]?)\.(inf|nan)$", r"\1\2", value, flags=re.IGNORECASE)
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name} must be a number, got {value!r}") from None
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{name} must be text, got {value!r}")
    text = value or ""
    # a path's spaces around it are a slip of the command line ("log.run_dir= runs/a" made a directory " ")
    return os.path.expanduser(text.strip()) if name in PATHS else text


@functools.cache
def _hints(cls) -> dict[str, type]:
    """A config section's field types, evaluated once (a layout search validates thousands of configs)."""
    return typing.get_type_hints(cls)


def _text_field(obj, path: list[str]) -> bool:
    """Whether the dotted path names a string setting (its override is then taken as written, not as YAML)."""
    for key in path[:-1]:
        obj = getattr(obj, key, None)
        if not dataclasses.is_dataclass(obj):
            return False
    return path[-1] in _fields(obj) and _hints(type(obj))[path[-1]] is str


def _set(obj, path: list[str], value, where: str = "", root=None) -> None:
    fields, key, root = _fields(obj), path[0], root or obj
    if key not in fields:
        raise _unknown(key, obj, where, root)
    current = getattr(obj, key)
    if dataclasses.is_dataclass(current):
        if len(path) == 1:
            if not isinstance(value, dict) and value is not None:  # an empty section (`model:`) changes nothing
                raise ConfigError(f"'{where}{key}' is a section; give it a mapping")
            for k, v in (value or {}).items():
                _set(current, [str(k)], v, f"{where}{key}.", root)
            return
        _set(current, path[1:], value, f"{where}{key}.", root)
        return
    if len(path) > 1:
        raise ConfigError(f"'{where}{key}' is a value, not a section")
    typ = _hints(type(obj))[key]
    setattr(obj, key, _coerce(value, typ, where + key))


class _ConfigLoader(yaml.SafeLoader):
    """safe_load's loader with every plain value read as its text, converted by its setting's type as an override
    is (YAML 1.1 would read `run_dir: 0755` as 493, `sample_prompt: no` as False), but for null and merge keys
    (`<<:`); a key given twice in one mapping is refused (PyYAML would settle it by the last)."""

    yaml_implicit_resolvers: dict = {}


_ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"),
                                    ["~", "n", "N", ""])
_ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:merge", re.compile(r"^<<$"), ["<"])


def _mapping(loader: _ConfigLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    written = [k for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"]  # a merge's keys may be set again
    keys = [loader.construct_object(k, deep=True) for k in written]
    twice = next((i for i, k in enumerate(keys) if k in keys[:i]), None)
    if twice is not None:
        raise yaml.constructor.ConstructorError(None, None, f"key {keys[twice]!r} is given twice",
                                                written[twice].start_mark)
    return loader.construct_mapping(node, deep)


_ConfigLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_config(path: str | Path | None = None, overrides: list[str] = (), check: bool = True,
                fill: bool = True) -> Config:
    """Build a Config from an optional YAML file and `a.b=value` overrides, then validate it (unless not
    `check`: a layout read before the settings that depend on it are added). With `fill`, the model settings
    neither gives are those of the checkpoint it resumes from (_model_from_checkpoint)."""
    cfg, given = Config(), set()  # given: the model.* keys the file or an override sets
    if path is not None:
        if not str(path):
            raise ConfigError("the config file's path is empty: give a YAML file (see configs/ for examples), or "
                              "none")
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config file {p} is a directory: give a YAML file (see configs/ for examples)")
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist (see configs/ for examples)")
        try:
            data = yaml.load(p.read_text(), Loader=_ConfigLoader) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {p} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections")
        try:
            for k, v in data.items():
                _set(cfg, [str(k)], v)
        except ConfigError as e:  # which file says it (an override is named by its key alone)
            raise ConfigError(f"config file {p}: {e}") from None
        given |= _model_keys(["model"], data.get("model"))
    for item in overrides:
        if "=" not in item or not item.split("=", 1)[0].strip():
            first = " (the config file comes first, and only one)" if item.endswith((".yaml", ".yml")) else ""
            raise ConfigError(f"override '{item}' must look like section.key=value{first}")
        key, raw = item.split("=", 1)
        path = key.strip().split(".")
        try:
            value = raw if _text_field(cfg, path) or not raw else yaml.load(raw, Loader=_ConfigLoader)
        except yaml.YAMLError:
            raise ConfigError(f"override '{item}': the value is not valid YAML") from None
        _set(cfg, path, value)
        given |= _model_keys(path, value)
    if fill and cfg.checkpoint.names_checkpoint():
        _model_from_checkpoint(cfg, given)
    if check:
        validate(cfg)
    return cfg


def _model_keys(path: list[str], value) -> set[str]:
    """The model.* keys that setting `path` to `value` gives."""
    if path[0] != "model":
        return set()
    return {path[1]} if len(path) > 1 else {str(k) for k in value} if isinstance(value, dict) else set()


def _model_from_checkpoint(cfg: Config, given: set[str]) -> None:
    """The model.* settings not given, but for RUNTIME ones, are those of the checkpoint the run starts from (a
    model imported from Hugging Face is trained on without restating its shape); a checkpoint that cannot be read
    is left to be refused where it is loaded."""
    missing = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in given and f.name not in RUNTIME]
    from .checkpoint import Checkpoint, CheckpointError, resume_source
    resume = resume_source(cfg.checkpoint, cfg.log.run_dir)
    if not (missing and resume):
        return
    try:
        with warnings.catch_warnings():  # said again where it is loaded
            warnings.simplefilter("ignore")
            saved = Checkpoint(resume).meta["config"]["model"]
    except (CheckpointError, KeyError, TypeError):
        return
    for key in missing:
        if key in saved:  # (older checkpoints lack newer keys: their defaults)
            try:
                _set(cfg, ["model", key], saved[key])
            except ConfigError as e:
                raise ConfigError(f"the checkpoint {resume} has {e}; set model.{key} here") from None
    _unset(cfg.model, set(inert(cfg.model)) - given)  # (an earlier version saved them without effect)


def _unset(model: ModelConfig, keys) -> None:
    """The model settings `keys` back at their defaults."""
    for key in keys:
        setattr(model, key, getattr(ModelConfig(), key))


def _validate_saved(cfg: Config) -> Config:
    """Validate a config that a run or checkpoint saved: a setting an earlier version accepted without effect is
    dropped, so that its runs stay readable."""
    if cfg.parallel.zero != 3:
        cfg.parallel.reshard_after_forward = None
    _unset(cfg.model, inert(cfg.model))
    validate(cfg)
    return cfg


def config_from_dict(data: dict) -> Config:
    """A saved config (a checkpoint's or a job plan's)."""
    cfg = Config()
    for k, v in data.items():
        _set(cfg, [k], v)
    return _validate_saved(cfg)


def load_saved_config(path: str | Path) -> Config:
    """A run directory's config.yaml; a setting it refuses is named with the file, and so is one that lacks a
    section (a run writes all of them: an empty or cut file would be read as defaults, as a single process)."""
    try:
        cfg = _validate_saved(load_config(path, check=False, fill=False))
        missing = [f.name for f in dataclasses.fields(Config)
                   if f.name not in (yaml.load(Path(path).read_text(), Loader=_ConfigLoader) or {})]
        if missing:
            raise ConfigError(f"it has no {', '.join(missing)} section(s), which a run writes: it was cut short or is "
                              f"not a run's; put the run's settings back there (the config a run prints as it starts)")
        return cfg
    except ConfigError as e:
        raise ConfigError(str(e) if str(path) in str(e) else f"{path}: {e}") from None


def shown(value) -> str:
    """A setting's value as a message gives it: repr, but booleans as YAML writes them (true, not True)."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def check_text(text: str, name: str) -> None:
    """Refuse text holding bytes that are not UTF-8 (a command line's, which Python keeps as surrogates)."""
    bad = next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), None)
    if bad is not None:
        raise ConfigError(f"{name} is not UTF-8 text (byte 0x{ord(text[bad]) & 0xff:02x} at character {bad}); "
                          f"give it in UTF-8")


def check_world_size(p: ParallelConfig, world_size: int, name: str = "world size", remedy: str = "") -> None:
    """Refuse a world size (named `name`) other than the layout's rank count; `remedy`: what else to change
    (by default, launching as many processes)."""
    if world_size != p.world_size:
        raise ConfigError(
            f"{name} {world_size} does not equal pp*dp_replicate*dp_shard*cp*tp = "
            f"{p.pp}*{p.dp_replicate}*{p.dp_shard}*{p.cp}*{p.tp} = {p.world_size}; change the parallel.* sizes or "
            + (remedy or f"launch {p.world_size} process{'es' if p.world_size > 1 else ''} (--nproc {p.world_size})"))


SEEDS = 2 ** 63  # a seed is below this (torch.Generator takes 64-bit seeds; sixfold's are non-negative)


def seed_problem(seed: int) -> str:
    """What is wrong with a random seed, to follow its name ("" for one torch.Generator takes)."""
    return "" if 0 <= seed < SEEDS else "must be from 0 to 2**63 - 1"


def temperature_problem(temperature: float) -> str:
    """What is wrong with a sampling temperature, to follow its name ("" for 0 or a positive finite number)."""
    return "" if 0 <= temperature < float("inf") else "must be 0 (greedy) or a positive number"


def top_p_problem(top_p: float) -> str:
    """What is wrong with a nucleus-sampling probability, to follow its name ("" for one above 0, at most 1)."""
    return "" if 0 < top_p <= 1 else "must be above 0 and at most 1 (1: every token)"


def bpe_size_problem(size: int) -> str:
    """What is wrong with a BPE vocabulary to train, to follow its name ("" for one that holds the bytes and an
    end of text)."""
    return "" if size >= 258 else "must be at least 258 (256 bytes and <|endoftext|>)"


RUN_CONFIG_HEAD = "# the resolved config of the sixfold run in this directory\n"
PICTURES = ("timeline.png", "schedule.png", "mesh.png")  # what pictures.py draws into a run directory
# what a run writes into its directory at its end, besides metrics.jsonl and checkpoints (True: a directory)
SUMMARIES = {"comm_ledger.json": False, "trace.json": False, **dict.fromkeys(PICTURES, False), "tensorboard": True}


META = "meta.json"  # a checkpoint's index, the file that makes a directory one


def checkpoint_over(path: str | Path, itself: bool = False) -> Path | None:
    """The checkpoint, or run's checkpoints/ folder, that `path` lies inside (or is, if `itself`): its contents are
    what checkpoint saves replace and checkpoint.keep removes. None where there is none."""
    resolved = Path(path).resolve()
    for p in [resolved] * itself + list(resolved.parents):
        if ((p / META).is_file() and any(p.glob("*.safetensors"))) or (
                p.name == "checkpoints" and (p / "latest").is_file()):
            return p
    return None


def make_run_dir(cfg: Config) -> Path:
    """The run directory, created; refused early (before any process starts) if it cannot be written, or if its
    config.yaml, which the run replaces, is not a sixfold run's (the config file being trained from, say)."""
    if not cfg.log.run_dir.strip():
        raise ConfigError("log.run_dir is empty: set it to the directory for this run's checkpoints, metrics and "
                          "trace")
    if holder := checkpoint_over(cfg.log.run_dir, itself=True):
        where = "is" if holder == Path(cfg.log.run_dir).resolve() else "is inside"
        raise ConfigError(f"log.run_dir {cfg.log.run_dir} {where} {holder}, whose contents checkpoint saves replace "
                          f"and checkpoint.keep removes (this run's with them): set log.run_dir outside any run's "
                          f"checkpoints/ folder")
    if cfg.data.source != "stdlib" and os.path.realpath(cfg.data.source) == os.path.realpath(cfg.log.run_dir):
        raise ConfigError(f"data.source and log.run_dir are both {cfg.data.source}: the run would write its "
                          f"metrics, config and checkpoints among its corpus and read them as text when next "
                          f"started; set log.run_dir to another directory")
    directory = writable_dir(cfg.log.run_dir, "log.run_dir")
    writes = {"checkpoints": True, "checkpoints/latest": False, "metrics.jsonl": False, "config.yaml": False,
              **SUMMARIES}
    for name, is_dir in writes.items():  # what the run writes: refused now, not after its training
        path = directory / name
        if (name != "tensorboard" or cfg.log.tensorboard) and path.exists() and path.is_dir() != is_dir:
            raise ConfigError(f"{path} is not a {'directory' if is_dir else 'file'}, and this run writes one there: "
                              f"set log.run_dir to another directory, or move it away")
    checkpoints = directory / "checkpoints"
    if checkpoints.is_dir():  # where its checkpoints and its pointer to the latest go, on resuming too
        try:
            _probe(checkpoints)
        except OSError as e:
            raise ConfigError(f"{checkpoints} cannot be written ({e.strerror or e}), and this run writes its "
                              f"checkpoints there: make it writable, or set log.run_dir to another directory") from None
    own = directory / "config.yaml"
    if own.is_file() and not run_directory(directory):
        raise ConfigError(f"{own} was not written by a sixfold run, and this run would replace it with its resolved "
                          f"config: set log.run_dir to another directory, or move that file away")
    return directory


def run_directory(path: Path) -> bool:
    """Whether `path` is a sixfold run's directory: it holds a config.yaml that opens with RUN_CONFIG_HEAD, or, from
    before that line, that has metrics.jsonl or checkpoints/ beside it."""
    config = path / "config.yaml"
    if not config.is_file():
        return False
    if (path / "metrics.jsonl").is_file() or (path / "checkpoints").is_dir():
        return True
    try:
        with open(config, "rb") as f:
            return f.read(len(RUN_CONFIG_HEAD)) == RUN_CONFIG_HEAD.encode()
    except OSError:  # unreadable: not taken for a run's
        return False


def _probe(directory: Path) -> None:
    """A file written into `directory` and removed (OSError if it cannot be)."""
    probe = directory / f".write-test-{socket.gethostname()}-{os.getpid()}"  # ranks of other machines too
    probe.write_text("")
    probe.unlink()


def writable_dir(path: str | Path, setting: str) -> Path:
    """Directory `path` (given as `setting`), created and checked writable."""
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{setting}={path} is a file, not a directory: set {setting} to a directory (or move the "
                          f"file away)")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _probe(directory)
    except OSError as e:
        raise ConfigError(f"{setting}={path} cannot be written ({e.strerror or e}); set {setting} to a writable "
                          f"directory") from None
    return directory


def check_available(cfg: Config) -> None:
    """Refuse what this machine cannot run."""
    if cfg.train.precision == "bf16":
        import torch
        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            raise ConfigError("train.precision=bf16: this GPU has no bf16 support; set train.precision=fp32")


def check_tensorboard(cfg: Config) -> None:
    """Refuse log.tensorboard=true where the package is missing, before training starts."""
    if cfg.log.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("log.tensorboard=true needs the tensorboard package: install it (pip install tensorboard), "
                          "or set log.tensorboard=false")


def inert(m: ModelConfig) -> tuple[str, ...]:
    """The model settings that change nothing under the others (the RoPE scaling fields its kind does not use)."""
    return {"none": ("rope_factor", "rope_low_freq", "rope_high_freq", "rope_original_len"),
            "linear": ("rope_low_freq", "rope_high_freq", "rope_original_len")}.get(m.rope_scaling, ())


def differing(a: dict, b: dict, sections: tuple[str, ...] | None = None) -> list[tuple[str, object, object]]:
    """(section.key, a's value, b's) for each setting that two configs' to_dict() hold differently, in b's order
    (of `sections`, or all); data.cache_dir, each machine's own, aside."""
    return [(f"{s}.{k}", a[s][k], v) for s in sections or b for k, v in b[s].items()
            if a[s][k] != v and f"{s}.{k}" != "data.cache_dir"]


def override(overrides: list[str], key: str) -> str | None:
    """The override among `overrides` that sets `key` (section.key), if one does."""
    return next((o for o in overrides if o.split("=", 1)[0].strip() == key), None)


def check_bpe_size(cfg: Config) -> None:
    """A BPE to be trained (data.tokenizer=bpe) must hold the bytes and an end of text, and fit the model's
    vocabulary: refused before the corpus is read."""
    size = cfg.data.bpe_vocab_size
    if cfg.data.tokenizer == "bpe" and bpe_size_problem(size):
        raise ConfigError(f"data.bpe_vocab_size={size} {bpe_size_problem(size)}")
    if cfg.data.tokenizer == "bpe" and size > cfg.model.vocab_size:
        raise ConfigError(f"data.bpe_vocab_size={size} is more than model.vocab_size="
                          f"{cfg.model.vocab_size}, which must hold every token: lower data.bpe_vocab_size or raise "
                          f"model.vocab_size")


def _check_sizes(cfg: Config) -> None:
    """Every whole-number setting below 2**31 (steps, batches, lengths, counts: a larger one overflows where it
    is used), but data.max_bytes (below 2**63) and the seed (checked on its own)."""
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        for key, typ in _hints(type(obj)).items():
            value, limit = getattr(obj, key), 63 if key == "max_bytes" else 31
            if typ is int and key != "seed" and abs(value) >= 2**limit:
                raise ConfigError(f"{section.name}.{key}={value} must be {'below ' if value > 0 else 'above -'}"
                                  f"2**{limit}")


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Refuse layouts and settings that cannot work, naming the setting to change."""
    _check_sizes(cfg)
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.zero not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero={p.zero}: choose 0 (replicate), 1 (optimizer state sharded), "
                          f"2 (and gradients) or 3 (and parameters)")
    for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallel.{name}={getattr(p, name)} must be at least 1")
    for key in ("steps", "seq_len", "global_batch", "micro_batches"):
        if getattr(t, key) < 1:
            raise ConfigError(f"train.{key}={getattr(t, key)} must be at least 1")
    if p.zero and p.dp_shard * p.cp == 1:
        raise ConfigError(f"parallel.zero={p.zero} shards over the dp_shard x cp ranks and this layout has one "
                          f"(dp_shard={p.dp_shard}, cp={p.cp}): set parallel.dp_shard above 1, or parallel.zero=0 "
                          f"(dp_replicate alone all-reduces the gradients, as DDP)")
    if world_size is not None:
        check_world_size(p, world_size)
    if m.moe_experts > 0 and not 1 <= m.moe_top_k <= m.moe_experts:
        raise ConfigError(f"model.moe_top_k={m.moe_top_k} must be between 1 and model.moe_experts={m.moe_experts}")
    if p.ep > 1 and m.moe_experts <= 0:
        raise ConfigError(f"parallel.ep={p.ep} splits a model's experts, and this model has none "
                          f"(model.moe_experts={m.moe_experts}): set model.moe_experts, or parallel.ep=1")
    if p.ep > 1 and m.moe_experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide model.moe_experts={m.moe_experts} (the experts are "
                          f"split over ep); change parallel.ep or model.moe_experts")
    if (p.dp_shard * p.cp) % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide parallel.dp_shard*parallel.cp={p.dp_shard * p.cp} "
                          f"(expert parallel borrows those ranks); change parallel.ep, parallel.dp_shard or "
                          f"parallel.cp")
    if m.rope_scaling not in ("none", "linear", "llama3"):
        raise ConfigError(f"model.rope_scaling={m.rope_scaling!r}: choose none, linear or llama3")
    if not 0 < m.rope_factor < math.inf or not 0 < m.rope_low_freq < m.rope_high_freq < math.inf \
            or m.rope_original_len < 1:
        raise ConfigError(f"model.rope_factor={m.rope_factor} must be positive, 0 < model.rope_low_freq="
                          f"{m.rope_low_freq} < model.rope_high_freq={m.rope_high_freq}, and model.rope_original_len="
                          f"{m.rope_original_len} at least 1")
    if unused := [f"model.{k}={shown(getattr(m, k))}" for k in inert(m) if getattr(m, k) != getattr(ModelConfig(), k)]:
        one = len(unused) == 1
        raise ConfigError(f"{', '.join(unused)}: model.rope_scaling={m.rope_scaling} leaves {'it' if one else 'them'} "
                          f"unused (rope_factor scales under linear and llama3, the others under llama3); set "
                          f"model.rope_scaling, or leave {'it' if one else 'those'} out")
    if m.recompute not in ("none", "selective", "full"):
        raise ConfigError(f"model.recompute={m.recompute!r}: choose none, selective (the attention core) or full "
                          "(every sub-layer from its input)")
    if m.loss_chunk < 0:
        raise ConfigError(f"model.loss_chunk={m.loss_chunk} must be 0 (no chunks) or a number of tokens")
    if m.loss_chunk and p.tp > 1:
        raise ConfigError(f"model.loss_chunk={m.loss_chunk} applies at parallel.tp=1: under tp={p.tp} each rank "
                          f"holds logits for 1/tp of the vocabulary already; set model.loss_chunk=0")
    if m.moe_experts < 0:
        raise ConfigError(f"model.moe_experts={m.moe_experts} must be 0 (a dense model) or more")
    if m.moe_every < 1:
        raise ConfigError(f"model.moe_every={m.moe_every} must be at least 1 (1: every block is MoE)")
    for key in ("moe_aux_weight", "moe_z_weight"):
        if not 0 <= getattr(m, key) < math.inf:
            raise ConfigError(f"model.{key}={getattr(m, key)} must be 0 (off) or a positive number")
    dense = ModelConfig()
    routing = [f"model.{k}={shown(getattr(m, k))}" for k in ("moe_top_k", "moe_norm_topk", "moe_every",
               "moe_shared_expert", "moe_aux_weight", "moe_z_weight") if getattr(m, k) != getattr(dense, k)]
    if routing and not m.moe_experts:
        raise ConfigError(f"{', '.join(routing)}: for MoE layers, and model.moe_experts=0 makes every layer dense; "
                          f"set model.moe_experts, or leave {'those' if len(routing) > 1 else 'it'} out")
    for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
        if getattr(m, key) < 1:
            raise ConfigError(f"model.{key}={getattr(m, key)} must be at least 1")
    if m.dim % m.n_heads:
        even = [d for d in divisors(m.dim) if m.dim // d % 2 == 0]  # an even head dimension, for RoPE
        heads = f", or model.n_heads to one of {_listed(even)}" if even else ""
        raise ConfigError(f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}: set model.dim to "
                          f"{_multiples(m.dim, 2 * m.n_heads)}{heads}")
    if m.head_dim % 2:
        raise ConfigError(f"head dimension {m.head_dim} (model.dim/model.n_heads) must be even for RoPE: change "
                          f"model.dim or model.n_heads")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}: set "
                          f"model.n_kv_heads to one of {_listed(divisors(m.n_heads))}")
    if p.tp > 1 and m.n_heads % p.tp:
        raise ConfigError(f"model.n_heads={m.n_heads} is not divisible by parallel.tp={p.tp}: set parallel.tp to one "
                          f"of {_listed(divisors(m.n_heads))}")
    if p.tp > 1 and m.n_kv_heads % p.tp and p.tp % m.n_kv_heads:
        fits = [d for d in divisors(m.n_heads) if m.n_kv_heads % d == 0 or d % m.n_kv_heads == 0]
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} and parallel.tp={p.tp}: one must divide the other (the "
                          f"kv heads are split over tp, or each repeated on several tp ranks); set parallel.tp to one "
                          f"of {_listed(fits)}")
    if p.cp_mode not in ("ring", "allgather", "ulysses"):
        raise ConfigError(f"parallel.cp_mode={p.cp_mode!r}: choose ring, allgather or ulysses")
    chunks = 2 * p.cp if p.cp_zigzag else p.cp
    if p.cp > 1 and t.seq_len % chunks:
        how = ("2 * parallel.cp, the zigzag chunks of a sequence; or set parallel.cp_zigzag=false"
               if p.cp_zigzag else "parallel.cp, the chunks of a sequence")
        raise ConfigError(f"train.seq_len={t.seq_len} must be divisible by {chunks}: set it to "
                          f"{_multiples(t.seq_len, chunks)} ({how})")
    if p.cp > 1 and p.tp > 1 and p.sequence_parallel and (t.seq_len // p.cp) % p.tp:
        raise ConfigError(f"train.seq_len/parallel.cp={t.seq_len // p.cp} must be divisible by parallel.tp={p.tp} "
                          f"under sequence-TP; change train.seq_len or set parallel.sequence_parallel=false")
    if p.cp > 1 and p.cp_mode == "ulysses" and m.n_heads % p.tp == 0:
        heads, kv_heads = m.n_heads // p.tp, max(m.n_kv_heads // p.tp, 1)
        wrong = ([f"the {heads} query head(s)"] if heads % p.cp else []) + \
            ([f"the {kv_heads} kv head(s)"] if kv_heads % p.cp and p.cp % kv_heads else [])
        if wrong:
            raise ConfigError(f"parallel.cp_mode=ulysses splits heads over cp: {' and '.join(wrong)} per tp rank "
                              f"must be divisible by parallel.cp={p.cp} (kv heads may be fewer if they divide it); use "
                              f"cp_mode=ring or allgather, or a cp that divides them")
    if p.tp > 1 and m.ffn_dim % p.tp:
        raise ConfigError(f"model.ffn_dim={m.ffn_dim} is not divisible by parallel.tp={p.tp}: set it to "
                          f"{_multiples(m.ffn_dim, p.tp)}")
    if p.tp > 1 and p.sequence_parallel and t.seq_len % p.tp:
        raise ConfigError(f"train.seq_len={t.seq_len} must be divisible by parallel.tp={p.tp} under sequence-TP; "
                          f"change it or set parallel.sequence_parallel=false")
    from .parallel.pipeline.schedules import check, check_name
    if p.pp == 1 and p.pp_virtual_stages > 1:
        raise ConfigError(f"parallel.pp_virtual_stages={p.pp_virtual_stages} splits each pipeline rank's layers into "
                          f"stages, and parallel.pp=1 runs no pipeline: set parallel.pp_virtual_stages=1, or "
                          f"parallel.pp to 2 or more")
    if p.pp > 1 or p.pp_virtual_stages != 1:
        from .parallel.pipeline.stages import check_stages
        check(p.pp_schedule, p.pp, p.pp_virtual_stages, t.micro_batches,
              t.global_batch // p.dp if t.global_batch % p.dp == 0 else None)
        check_stages(m, p.pp, p.pp_virtual_stages, p.pp_schedule)
        if p.zero == 3 and p.reshard_after_forward:
            raise ConfigError("parallel.reshard_after_forward=true: under pipelining ZeRO-3 gathers each stage's "
                              "weights once per step; leave it unset or set it to false")
    else:
        check_name(p.pp_schedule)
    if t.reduce_each_micro_batch and (p.zero < 2 or p.pp > 1):
        if p.zero < 2:
            sharded = " with parallel.dp_shard * parallel.cp above 1" if p.dp_shard * p.cp == 1 else ""
            why = f"parallel.zero={p.zero} keeps the full gradients between micro-batches anyway: set " \
                  f"parallel.zero to 2 or 3{sharded}"
        else:
            why = f"under pipelining (parallel.pp={p.pp}) a rank's gradients are reduced once, after the last " \
                  f"micro-batch: set parallel.pp=1"
        raise ConfigError(f"train.reduce_each_micro_batch=true frees the full gradients between micro-batches, and "
                          f"{why}, or train.reduce_each_micro_batch=false")
    if p.reshard_after_forward is not None and p.zero != 3:
        raise ConfigError(f"parallel.reshard_after_forward={shown(p.reshard_after_forward)} applies to "
                          f"parallel.zero=3 (sharded weights) and this layout has zero={p.zero}: leave it unset or "
                          f"set parallel.zero=3")
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}: set train.seq_len to "
                          f"at most {m.max_seq_len}, or raise model.max_seq_len")
    if t.skip_nonfinite < 0:
        raise ConfigError(f"train.skip_nonfinite={t.skip_nonfinite} must be 0 (stop at the first) or more")
    if said := seed_problem(t.seed):
        raise ConfigError(f"train.seed={t.seed} {said}")
    if t.global_batch % (p.dp * t.micro_batches):
        need = p.dp * t.micro_batches
        fix = f"set train.global_batch to a multiple of {need} (such as {-(-t.global_batch // need) * need})"
        interleaved = p.pp > 1 and p.pp_schedule == "interleaved"  # whose micro-batches are a multiple of pp
        fits = [k for k in divisors(t.global_batch // p.dp) if not interleaved or k % p.pp == 0] \
            if t.global_batch % p.dp == 0 else []
        if fits:
            fix += f", or train.micro_batches to one of {_listed(fits)}"
        raise ConfigError(
            f"train.global_batch={t.global_batch} must be divisible by data-parallel size "
            f"({p.dp} = dp_replicate*dp_shard) times train.micro_batches={t.micro_batches}: {fix}")
    if not (math.isfinite(t.lr) and math.isfinite(t.min_lr)) or t.warmup_steps < 0 or t.lr <= 0 or t.min_lr < 0:
        raise ConfigError(f"train.lr={t.lr} must be a finite number above 0, train.min_lr={t.min_lr} a finite number "
                          f"0 or more, train.warmup_steps={t.warmup_steps} 0 or more")
    if t.schedule not in LR_SCHEDULES:
        raise ConfigError(f"train.schedule={t.schedule!r}: choose {', '.join(LR_SCHEDULES[:-1])} or "
                          f"{LR_SCHEDULES[-1]}")
    if t.decay_steps and t.schedule == "constant":
        raise ConfigError(f"train.decay_steps={t.decay_steps} decays, and train.schedule=constant does not; set "
                          f"train.schedule to linear or cosine, or train.decay_steps=0")
    if t.decay_steps < 0:
        raise ConfigError(f"train.decay_steps={t.decay_steps} must be 0 (decay over every step after warmup) or more "
                          f"(decay over that many last steps, at train.lr before them)")
    if t.eval_every < 0 or (t.eval_every and t.eval_batches < 1):
        raise ConfigError(f"train.eval_every={t.eval_every} must be 0 (no evaluation) or more, and "
                          f"train.eval_batches={t.eval_batches} at least 1 when it is set")
    if not 1 <= p.timeout_s <= MAX_TIMEOUT_S:  # NaN too
        raise ConfigError(f"parallel.timeout_s={p.timeout_s} must be a number of seconds from 1 to {MAX_TIMEOUT_S}")
    if t.min_lr > t.lr and t.schedule != "constant":  # (a constant schedule never reaches min_lr)
        raise ConfigError(f"train.min_lr={t.min_lr:g}, where the schedule ends, is above train.lr={t.lr:g}, where it "
                          f"starts: set train.min_lr to at most {t.lr:g}")
    adam = {"beta1": 0 <= t.beta1 < 1, "beta2": 0 <= t.beta2 < 1, "eps": 0 < t.eps < 1,
            "weight_decay": 0 <= t.weight_decay < math.inf, "grad_clip": 0 <= t.grad_clip < math.inf}
    for key, ok in adam.items():
        if not ok:
            raise ConfigError(f"train.{key}={getattr(t, key)} is out of range: AdamW takes betas in [0, 1), eps in "
                              f"(0, 1), weight_decay and grad_clip 0 (off) or more")
    for key in ("norm_eps", "rope_theta", "init_std"):
        if not 0 < getattr(m, key) < math.inf:
            raise ConfigError(f"model.{key}={getattr(m, key)} must be a positive number")
    for key, zero in (("every", "no periodic ones"), ("keep", "keep all")):
        if getattr(cfg.checkpoint, key) < 0:
            raise ConfigError(f"checkpoint.{key}={getattr(cfg.checkpoint, key)} must be 0 ({zero}) or more")
    if cfg.checkpoint.init and cfg.checkpoint.resume not in ("", "auto"):
        raise ConfigError(f"checkpoint.init={cfg.checkpoint.init} is where a run starts when checkpoint.resume finds "
                          f"no checkpoint, and checkpoint.resume={cfg.checkpoint.resume} names one: leave one of them "
                          f"out (checkpoint.resume=auto goes on from this run's own, else from checkpoint.init)")
    if cfg.log.sample_tokens < 0 or (cfg.log.sample_tokens and not cfg.log.sample_prompt):
        raise ConfigError(f"log.sample_tokens={cfg.log.sample_tokens} must be 0 (no sample) or more, with a "
                          f"non-empty log.sample_prompt to start from")
    check_text(cfg.log.sample_prompt, "log.sample_prompt")
    if not cfg.data.source.strip():
        raise ConfigError("data.source is empty: name a file, a directory or a pattern (or stdlib)")
    if cfg.data.max_bytes < 0:
        raise ConfigError(f"data.max_bytes={cfg.data.max_bytes} must be 0 (all of the corpus) or more")
    if not cfg.data.cache_dir.strip():
        raise ConfigError("data.cache_dir is empty: set it to the directory that keeps the tokenized corpus "
                          "(by default ~/.cache/sixfold)")
    if not cfg.checkpoint.names_checkpoint():  # (a checkpoint may hold its tokenizer: see data_settings)
        check_bpe_size(cfg)
    for key in ("precision", "grad_reduce"):
        if getattr(t, key) not in DTYPES:
            raise ConfigError(f"train.{key}={getattr(t, key)!r}: choose fp32 or bf16")
    if cfg.data.format not in ("auto", "text", "jsonl", "bin"):
        raise ConfigError(f"data.format={cfg.data.format!r}: choose auto, text, jsonl or bin")
    d = cfg.data
    if d.jsonl_prompt_field and (d.source == "stdlib" or d.format in ("text", "bin")):
        raise ConfigError(f"data.jsonl_prompt_field={d.jsonl_prompt_field!r} reads prompts from JSON lines, and "
                          f"data.source={d.source!r} with data.format={d.format} is not; point data.source at .jsonl "
                          f"files, or leave data.jsonl_prompt_field unset")
    if not d.jsonl_field:
        raise ConfigError("data.jsonl_field is empty: name the field of a JSON line that holds its text (by default "
                          "'text')")
    if d.jsonl_prompt_field == d.jsonl_field:
        raise ConfigError(f"data.jsonl_prompt_field={d.jsonl_prompt_field!r} is data.jsonl_field too; name the field "
                          f"of the prompt and the field of the text that follows it")
    if cfg.data.bin_dtype not in ("uint16", "uint32"):
        raise ConfigError(f"data.bin_dtype={cfg.data.bin_dtype!r}: choose uint16 or uint32")
    if not 0 <= cfg.data.val_fraction < 1:
        raise ConfigError(f"data.val_fraction={cfg.data.val_fraction}, the share held out for validation, must be "
                          f"0 or more and below 1")
    if not cfg.data.val_fraction and t.eval_every:
        raise ConfigError(f"train.eval_every={t.eval_every} evaluates on the val split, which data.val_fraction=0 "
                          f"leaves empty: set data.val_fraction above 0, or train.eval_every=0")
    if cfg.log.every < 1:
        raise ConfigError(f"log.every={cfg.log.every} must be at least 1 (a log line every this many steps)")
