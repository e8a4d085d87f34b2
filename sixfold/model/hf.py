"""Hugging Face interop: LlamaForCausalLM and MixtralForCausalLM configs and safetensors weights in and out.

Both sides use rotate-half RoPE, so weights only change names, never layout; Mixtral's experts, one tensor
per expert in its published checkpoints (w1 gate, w3 up, w2 down) or fused per layer in transformers 5
(gate_up_proj, down_proj), are stacked per layer here. Export writes the published form, which every
transformers version reads.
"""
from __future__ import annotations

import json
import re
import shutil
import warnings
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..checkpoint import (META, Checkpoint, CheckpointError, check_shapes, opened, outside_checkpoints, require,
                          save_tensors, write_checkpoint, writing)
from ..slices import Reader
from ..config import DTYPES, Config, ConfigError, ModelConfig, config_from_dict, shown
from .llama import Llama, full_shapes

TOP_NAMES = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "head.weight": "lm_head.weight"}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "block_sparse_moe.gate.weight",
}
EXPERTS = {"mlp.experts.w_gate": "w1", "mlp.experts.w_up": "w3", "mlp.experts.w_down": "w2"}
# carried as they are from an imported directory, through training on its tokenizer, to an export: the tokenizer's
# settings (special tokens; the chat template, in a file of its own since transformers 4.43), carried only with
# the tokenizer, and generation's (its end tokens, several for an instruct model)
WITH_TOKENIZER = ("tokenizer_config.json", "chat_template.jinja", "chat_template.json")
CARRIED = (*WITH_TOKENIZER, "generation_config.json")
HF_TOP = {v: k for k, v in TOP_NAMES.items()}
HF_LAYER = {v: k for k, v in LAYER_NAMES.items()}


def hf_name(name: str) -> str:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    _, i, rest = name.split(".", 2)
    return f"model.layers.{i}.{LAYER_NAMES[rest]}"


def _as_hf(name: str) -> str:
    """A tensor's name as a Hugging Face directory has it, where it has one by that name (not an expert stack, nor
    a name sixfold does not know)."""
    try:
        return hf_name(name)
    except (KeyError, ValueError):
        return name


def sixfold_name(name: str) -> str:
    """The sixfold name of an HF tensor; unknown names come back unchanged so check_shapes reports them."""
    if name in HF_TOP:
        return HF_TOP[name]
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        rest = parts[3].replace("mlp.gate.weight", "block_sparse_moe.gate.weight")  # transformers 5 name
        if rest in HF_LAYER:
            return f"layers.{parts[2]}.{HF_LAYER[rest]}"
    return name


def _stack_experts(out: dict[str, torch.Tensor], n_layers: int, n_experts: int) -> None:
    """Mixtral's expert tensors, in either HF form, stacked per layer under sixfold names, in place (others
    untouched): each layer's separate tensors are dropped as its stack is made. None for a dense model's config
    (its check of the shapes names the experts' tensors it does not expect)."""
    for i in range(n_layers if n_experts else 0):
        legacy = f"model.layers.{i}.block_sparse_moe.experts"
        fused = f"model.layers.{i}.mlp.experts"
        if f"{fused}.gate_up_proj" in out:
            gate, up = out.pop(f"{fused}.gate_up_proj").chunk(2, dim=1)
            out.update({f"layers.{i}.mlp.experts.w_gate": gate, f"layers.{i}.mlp.experts.w_up": up,
                        f"layers.{i}.mlp.experts.w_down": out.pop(f"{fused}.down_proj")})
        elif f"{legacy}.0.w1.weight" in out:
            for ours, theirs in EXPERTS.items():
                names = [f"{legacy}.{j}.{theirs}.weight" for j in range(n_experts)]
                missing = [n for n in names if n not in out]
                if missing:
                    raise CheckpointError(f"the weights hold no {missing[0]} ({len(missing)} of layer {i}'s "
                                          f"{n_experts} experts, as config.json's num_local_experts says, missing)")
                out[f"layers.{i}.{ours}"] = torch.stack([out.pop(n) for n in names])


# transformers' defaults for what a config.json may leave out (LlamaConfig's, MixtralConfig's)
DEFAULTS = {
    "llama": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
              "num_key_value_heads": None, "initializer_range": 0.02},
    "mixtral": {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32,
                "num_key_value_heads": 8, "router_aux_loss_coef": 0.001, "initializer_range": 0.02},
}
# HF's RoPE scaling fields -> sixfold's model settings, by rope_type
ROPE = {"default": {}, "linear": {"factor": "rope_factor"},
        "llama3": {"factor": "rope_factor", "low_freq_factor": "rope_low_freq", "high_freq_factor": "rope_high_freq",
                   "original_max_position_embeddings": "rope_original_len"}}


def _rope(hf: dict, defaults: dict) -> dict:
    """The model settings of config.json's RoPE (transformers 5's rope_parameters, or the older rope_theta and
    rope_scaling): rope_theta if given, and rope_scaling with its fields; refuses the kinds sixfold lacks. As
    transformers reads them, a rope_scaling that is not empty replaces rope_parameters whole."""
    parts = [hf.get(k) or {} for k in ("rope_scaling", "rope_parameters")]
    if not all(isinstance(p, dict) for p in parts):
        raise ConfigError(f"config.json's rope_scaling and rope_parameters must be objects: {parts}")
    given = dict(parts[0] or parts[1])
    kind = given.get("rope_type", given.get("type", "default"))
    if kind not in ROPE:
        raise ConfigError(f"rope_type={kind!r} (config.json's rope_scaling or rope_parameters: {given}): sixfold's "
                          f"RoPE is {', '.join(ROPE)}")
    if kind == "llama3":  # as transformers reads it
        given.setdefault("original_max_position_embeddings",
                         hf.get("max_position_embeddings") or defaults["max_position_embeddings"])
    try:
        out = {ours: type(getattr(ModelConfig, ours))(given[theirs]) for theirs, ours in ROPE[kind].items()}
        if "rope_theta" in given:
            out["rope_theta"] = float(given["rope_theta"])
    except KeyError as e:
        raise ConfigError(f"rope_type={kind!r} without {e.args[0]} (config.json's rope_scaling or rope_parameters: "
                          f"{given})") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.json's RoPE settings {given} are not numbers where they must be: {e}") from None
    return {**out, "rope_scaling": "none" if kind == "default" else kind}


INTEGERS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "max_position_embeddings", "num_local_experts", "num_experts_per_tok", "head_dim",
            "sliding_window")
NUMBERS = ("rope_theta", "rms_norm_eps", "initializer_range", "router_aux_loss_coef", "router_jitter_noise")
# a model setting's name in a transformers config.json; those of MOE are Mixtral's alone
HF_NAMES = {"vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
            "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "ffn_dim": "intermediate_size",
            "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings",
            "max_seq_len": "max_position_embeddings", "init_std": "initializer_range",
            "moe_experts": "num_local_experts", "moe_top_k": "num_experts_per_tok",
            "moe_aux_weight": "router_aux_loss_coef"}
MOE = ("moe_experts", "moe_top_k", "moe_aux_weight")


def _names(mixtral: bool) -> dict:
    """HF_NAMES of a Llama, or of a Mixtral."""
    return {ours: theirs for ours, theirs in HF_NAMES.items() if mixtral or ours not in MOE}


def _read_json(file: Path) -> dict:
    """A JSON object from `file`, refused by name when unreadable."""
    try:
        data = json.loads(file.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as e:  # a decoding error is a ValueError too
        raise CheckpointError(f"{file} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} holds a JSON {type(data).__name__}, not an object")
    return data


def _check_numbers(hf: dict, source: str | Path) -> None:
    """Refuses, naming `source`, a count that is not an integer or another number that is not a number."""
    for key in (*INTEGERS, *NUMBERS):
        kind, what = (int, "an integer") if key in INTEGERS else ((int, float), "a number")
        if key in hf and (not isinstance(hf[key], kind) or isinstance(hf[key], bool)):
            raise ConfigError(f"{source}'s {key}={hf[key]!r} must be {what}")


def model_config_from_hf(hf: dict, source: str | Path = "config.json") -> ModelConfig:
    """A ModelConfig from a LlamaForCausalLM or MixtralForCausalLM config.json (`source`, as messages name it);
    refuses what sixfold cannot represent. A null setting is as if left out: transformers' default stands in."""
    hf = {k: v for k, v in hf.items() if v is not None}
    if hf.get("model_type") not in ("llama", "mixtral"):
        raise ConfigError(f"model_type={hf.get('model_type')!r}: only 'llama' and 'mixtral' models can be imported")
    if hf.get("quantization_config"):  # its weights are not the numbers they hold (scales, packing)
        quant = hf["quantization_config"]
        raise ConfigError(f"quantization_config={quant}: sixfold reads unquantized weights; import the model's bf16 or "
                          f"fp32 release")
    defaults = DEFAULTS[hf["model_type"]]
    rope = _rope(hf, defaults)
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConfigError(f"{flag}=true: sixfold's linear layers have no bias")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers' two names for one function
        raise ConfigError(f"hidden_act={hf['hidden_act']!r}: sixfold's MLP uses silu (SwiGLU)")
    if hf["model_type"] == "llama":  # a field transformers' Llama ignores (_check_numbers would judge it)
        hf.pop("sliding_window", None)
    _check_numbers(hf, source)
    if hf["model_type"] == "mixtral" and hf.get("router_jitter_noise", 0.0) > 0:
        warnings.warn(f"{source}'s router_jitter_noise={hf['router_jitter_noise']}: transformers multiplies an MoE "
                      f"layer's input by noise of that size in training; sixfold's routers train without noise "
                      f"(outside training both are the same)")
    given = {**defaults, "tie_word_embeddings": False, **hf}
    if given["num_key_value_heads"] is None and "num_attention_heads" in given:  # transformers: one per head
        given["num_key_value_heads"] = given["num_attention_heads"]
    window = hf.get("sliding_window") if hf["model_type"] == "mixtral" else None  # transformers' Llama has none
    if window and window < given["max_position_embeddings"]:  # a window as long as the context changes nothing
        raise ConfigError(f"sliding_window={window} is shorter than max_position_embeddings="
                          f"{given['max_position_embeddings']}: sixfold attends to the whole causal context")
    try:
        mine = {ours: type(getattr(ModelConfig, ours))(given[theirs])
                for ours, theirs in _names(hf["model_type"] == "mixtral").items()}
        cfg = ModelConfig(**{**mine, **rope})
    except KeyError as e:
        raise ConfigError(f"{source} has no value for {e.args[0]}; set it to the model's") from None
    if hf.get("head_dim") not in (None, cfg.head_dim):
        raise ConfigError(f"head_dim={hf['head_dim']} differs from hidden_size/num_attention_heads="
                          f"{cfg.head_dim}; sixfold derives head_dim from those")
    if cfg.moe_experts > 0 and cfg.n_layers > 0 and cfg.moe_aux_weight > 0:  # (a bad one is refused as it is)
        # transformers takes Mixtral's balancing loss once, over every layer's routing together (at even routing,
        # one layer's value); sixfold adds each layer's: its weight is router_aux_loss_coef over the layers
        cfg = replace(cfg, moe_aux_weight=cfg.moe_aux_weight / cfg.n_layers)
    return replace(cfg, moe_z_weight=0.0) if cfg.moe_experts else cfg  # Mixtral trains with no router z-loss


def hf_config_from_model(cfg: ModelConfig) -> dict:
    """config.json for a LlamaForCausalLM (or MixtralForCausalLM) equal to a sixfold Llama."""
    if cfg.moe_experts and (cfg.moe_every != 1 or cfg.moe_shared_expert):
        raise ConfigError("only MoE on every layer without a shared expert (Mixtral) can be exported: "
                          f"model.moe_every={cfg.moe_every}, model.moe_shared_expert={shown(cfg.moe_shared_expert)}")
    if cfg.moe_experts and not cfg.moe_norm_topk:
        raise ConfigError("Mixtral renormalises the chosen experts' weights: a model trained with "
                          "model.moe_norm_topk=false cannot be exported as one")
    moe = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "output_router_logits": False,
           "router_jitter_noise": 0.0, "sliding_window": None} if cfg.moe_experts else {}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            **{theirs: getattr(cfg, ours) for ours, theirs in _names(bool(cfg.moe_experts)).items()},
            **({"router_aux_loss_coef": cfg.moe_aux_weight * cfg.n_layers} if cfg.moe_experts else {}),  # (per layer)
            "head_dim": cfg.head_dim, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
            "mlp_bias": False,
            "rope_scaling": None if cfg.rope_scaling == "none" else
            {"rope_type": cfg.rope_scaling, **{k: getattr(cfg, ours) for k, ours in ROPE[cfg.rope_scaling].items()}},
            **moe}


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file} is not a readable safetensors file: {e}") from None


def read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards named by model.safetensors.index.json."""
    single, index = hf_dir / "model.safetensors", hf_dir / "model.safetensors.index.json"
    if single.is_file():
        return _read_safetensors(single)
    if not index.is_file():
        raise CheckpointError(f"{hf_dir} has no model.safetensors or model.safetensors.index.json "
                              f"(.bin weights are not read; save with safe_serialization)")
    tensors = {}
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index} has no 'weight_map' object (tensor name: shard file)")
    for shard in sorted(set(map(str, weight_map.values()))):
        if not (hf_dir / shard).is_file():
            raise CheckpointError(f"{index} names shard {shard}, which is missing")
        tensors.update(_read_safetensors(hf_dir / shard))
    return tensors


def _new_output(out_dir: str | Path) -> Path:
    """out_dir, refused if something is there already, or inside a checkpoint: nothing of the user's is
    overwritten, and nothing written is removed with an old checkpoint."""
    out_dir = Path(out_dir)
    outside_checkpoints(out_dir)
    if out_dir.is_file() or (out_dir.is_dir() and any(out_dir.iterdir())):
        what = "is a file" if out_dir.is_file() else "exists and is not empty"
        raise CheckpointError(f"{out_dir} {what}, and writing there would replace what it holds; give a new output "
                              f"path, or move it away")
    return out_dir


IMPORTED = "import-hf"  # how an imported checkpoint's meta.json names its source


def imported(meta: dict) -> bool:
    """Whether the checkpoint of this meta.json was written by import_hf."""
    return str(meta.get("source", "")).startswith(IMPORTED)


def import_hf(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Turn a LlamaForCausalLM directory into a sixfold checkpoint (fp32) at out_dir (a new directory), with its
    tokenizer.json where sixfold can use it."""
    hf_dir, out_dir = Path(hf_dir), _new_output(out_dir)
    if not hf_dir.is_dir():
        raise CheckpointError(f"{hf_dir} {'is not a directory' if hf_dir.exists() else 'does not exist'}; give a "
                              f"directory written by save_pretrained")
    if not (hf_dir / "config.json").is_file():
        raise CheckpointError(f"{hf_dir} has no config.json; give a directory written by save_pretrained")
    model_cfg = model_config_from_hf(_read_json(hf_dir / "config.json"), hf_dir / "config.json")
    cfg = Config(model=model_cfg)
    cfg.train.seq_len = min(cfg.train.seq_len, model_cfg.max_seq_len)
    try:
        config_from_dict(cfg.to_dict())  # validates the imported shape
    except ConfigError as e:  # said in config.json's names, the file to change
        said = re.sub(r"model\.(\w+)", lambda m: HF_NAMES.get(m[1], m[0]), str(e))
        raise ConfigError(f"{hf_dir / 'config.json'}: {said}") from None
    read = read_hf_weights(hf_dir)
    _stack_experts(read, model_cfg.n_layers, model_cfg.moe_experts)
    tensors = {}
    for k in list(read):  # each source tensor freed as its fp32 copy is made: at most about 2x the bf16 bytes
        v = read.pop(k)
        if not k.endswith("rotary_emb.inv_freq"):
            tensors[sixfold_name(k)] = v.float()
    if model_cfg.tie_embeddings:  # either name may hold the one copy, as transformers ties them
        head = tensors.pop("head.weight", None)
        if "embed.weight" not in tensors and head is not None:
            tensors["embed.weight"] = head
    check_shapes(full_shapes(model_cfg), {k: v.shape for k, v in tensors.items()}, str(hf_dir),
                 "its weights do not match its config.json", _as_hf)
    meta = {"step": 0, "config": cfg.to_dict(), "source": f"{IMPORTED} {hf_dir}"}
    blobs = _tokenizer(hf_dir, model_cfg.vocab_size)
    return write_checkpoint(out_dir, {"model": tensors}, meta, {**blobs, **_carried(hf_dir, blobs)})


def _tokenizer(hf_dir: Path, vocab_size: int) -> dict[str, bytes]:
    """The directory's tokenizer.json as a checkpoint's blob, if it has one that sixfold can use (an end-of-text
    token, no id beyond the model's vocabulary); else none, with a warning saying why."""
    from ..data import BPETokenizer, DataError
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        warnings.warn(f"{hf_dir} has no tokenizer.json: the checkpoint holds no tokenizer; train from it with "
                      f"data.tokenizer set to the model's tokenizer.json")
        return {}
    try:
        text = path.read_bytes()
        tok = BPETokenizer.from_json(text.decode(), str(path))
        if tok.vocab_size > vocab_size:
            raise DataError(f"its {tok.vocab_size} tokens are more than the model's {vocab_size}")
    except (OSError, UnicodeDecodeError, DataError) as e:  # unreadable, not a tokenizers file, no end of text
        warnings.warn(f"{path} is not carried over ({e}); train from the checkpoint with data.tokenizer set to a "
                      f"tokenizer.json that fits the model")
        return {}
    return {"tokenizer.json": text}


def _carried(hf_dir: Path, blobs: dict[str, bytes]) -> dict[str, bytes]:
    """The directory's CARRIED files that are readable (JSON objects, or UTF-8 text), WITH_TOKENIZER ones only
    beside its tokenizer.json."""
    out = {}
    for name in CARRIED:
        path = hf_dir / name
        if not path.is_file() or (name in WITH_TOKENIZER and "tokenizer.json" not in blobs):
            continue
        try:
            data = path.read_bytes()
            if name.endswith(".json"):
                _read_json(path)
            data.decode("utf-8")
        except (CheckpointError, OSError, UnicodeDecodeError) as e:
            warnings.warn(f"{path} is not carried over ({e})")
            continue
        out[name] = data
    return out


def saved_config(checkpoint: Checkpoint) -> Config:
    """The Config a checkpoint was written with."""
    require(checkpoint.meta, {"config": dict}, checkpoint.path / META)
    return config_from_dict(checkpoint.meta["config"])


def load_model(source: str | Path | Checkpoint, device: str | torch.device = "cpu") -> tuple[Llama, Config]:
    """A sixfold Llama (fp32) and its Config from a checkpoint or run directory, or an opened checkpoint."""
    checkpoint = opened(source)
    cfg = saved_config(checkpoint)
    weights = Reader(checkpoint, "model")
    check_shapes(full_shapes(cfg.model), weights.shapes(), f"{checkpoint.path} (model)")
    tensors = weights.all()
    with torch.device("meta"):
        model = Llama(cfg.model)
    model.load_state_dict({k: v.float() for k, v in tensors.items()}, assign=True)
    return model.to(device), cfg


SHARD_BYTES = 5 * 10**9  # transformers' own default for save_pretrained


def export_hf(path: str | Path, out_dir: str | Path, dtype: str = "fp32", shard_bytes: int = SHARD_BYTES) -> Path:
    """Write a sixfold checkpoint as a LlamaForCausalLM or MixtralForCausalLM directory (config.json, the
    weights in `dtype` as model.safetensors or, above shard_bytes, shards with their index, and the tokenizer it was
    trained with as tokenizer.json: its BPE, or bytes as byte-level BPE with no merges) at out_dir (a new directory)."""
    if dtype not in DTYPES:
        raise CheckpointError(f"cannot export as {dtype!r}: choose one of {', '.join(DTYPES)}")
    from ..data import DataError
    from ..generate import checkpoint_tokenizer
    out_dir = _new_output(out_dir)
    checkpoint = Checkpoint(path)
    model, cfg = load_model(checkpoint)
    try:  # its end-of-text token is the model's eos (not LlamaConfig's default 2, a byte for a byte model)
        tok = checkpoint_tokenizer(checkpoint, cfg)
    except DataError:
        tok = None
    carried = carried_files(checkpoint)
    hf = {**hf_config_from_model(cfg.model), "bos_token_id": tok.start[0] if tok and tok.start_token else None,
          "eos_token_id": tok.eot if tok else None, **special_ids(carried), "torch_dtype": DTYPES[dtype]}
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot write under {out_dir} ({e.strerror or e}); choose a writable directory") \
            from None
    try:
        with writing(out_dir):
            _write_hf(out_dir, model, hf, tok, carried, cfg, dtype, shard_bytes)
    except CheckpointError:  # a full disk, say: nothing half written is left
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
    return out_dir


def carried_files(checkpoint: Checkpoint) -> dict[str, bytes]:
    """The CARRIED files a checkpoint holds, by name."""
    return {name: checkpoint.blob(name) for name in CARRIED if name in checkpoint.meta["files"]}


def end_ids(carried: dict[str, bytes]) -> list[int]:
    """The end tokens of a carried generation_config.json (an instruct model's end of turn among them)."""
    eos = special_ids(carried).get("eos_token_id")
    return [] if eos is None else eos if isinstance(eos, list) else [eos]


def _generation(carried: dict[str, bytes]) -> dict:
    """A carried generation_config.json's settings ({} if none is carried)."""
    return json.loads(carried.get("generation_config.json", b"{}"))


def special_ids(carried: dict[str, bytes]) -> dict:
    """The bos_token_id and eos_token_id (an id, or a list of them) of a carried generation_config.json."""
    generation = _generation(carried)
    return {k: generation[k] for k in ("bos_token_id", "eos_token_id") if k in generation}


HF_SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}  # transformers' GenerationConfig defaults


def sampling(carried: dict[str, bytes]) -> dict:
    """The temperature, top_k and top_p a carried generation_config.json samples with, as transformers reads it (its
    defaults for those it leaves out), where its do_sample is true; else none (transformers then decodes greedily,
    which an instruction-tuned model's file does not ask for)."""
    generation = _generation(carried)
    if generation.get("do_sample") is not True:
        return {}
    return {k: default if generation.get(k) is None else generation[k] for k, default in HF_SAMPLING.items()}


def _write_hf(out_dir: Path, model: Llama, hf: dict, tok, carried: dict[str, bytes], cfg: Config, dtype: str,
              shard_bytes: int) -> None:
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2))
    if tok is not None:  # AutoTokenizer reads the pair, with the end-of-text token as its eos
        (out_dir / "tokenizer.json").write_text(tok.to_json())
    if tok is not None and "tokenizer_config.json" not in carried:
        (out_dir / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eot_token,
             **({"bos_token": tok.start_token} if tok.start_token else {}),
             "model_max_length": cfg.model.max_seq_len}, indent=2))
    for name, data in carried.items():  # as the imported directory had them
        (out_dir / name).write_bytes(data)
    tensors = {}
    for k, v in model.state_dict().items():
        layer, _, rest = k.removeprefix("layers.").partition(".")
        if rest in EXPERTS:
            tensors.update({f"model.layers.{layer}.block_sparse_moe.experts.{j}.{EXPERTS[rest]}.weight": w
                            for j, w in enumerate(v)})
        else:
            tensors[hf_name(k)] = v
    _save_shards({k: v.to(getattr(torch, DTYPES[dtype])).contiguous() for k, v in tensors.items()}, out_dir,
                 shard_bytes)


def _save_shards(tensors: dict[str, torch.Tensor], out_dir: Path, shard_bytes: int) -> None:
    """model.safetensors, or consecutive shards of at most shard_bytes (a larger tensor alone) with
    model.safetensors.index.json, as save_pretrained writes them."""
    shards, size = [{}], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name], size = t, size + nbytes
    if len(shards) == 1:
        save_tensors(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_tensors(shard, out_dir / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
