"""Hugging Face interop: LlamaForCausalLM configs and safetensors weights in and out.

Both sides use rotate-half RoPE, so weights only change names, never layout.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..checkpoint import CheckpointError, check_shapes, find_checkpoint, read_meta, read_tensors, write_checkpoint
from ..config import Config, ConfigError, ModelConfig, config_from_dict
from .llama import Llama

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
}
HF_TOP = {v: k for k, v in TOP_NAMES.items()}
HF_LAYER = {v: k for k, v in LAYER_NAMES.items()}


def hf_name(name: str) -> str:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    _, i, rest = name.split(".", 2)
    return f"model.layers.{i}.{LAYER_NAMES[rest]}"


def sixfold_name(name: str) -> str:
    """The sixfold name of an HF tensor; unknown names come back unchanged so check_shapes reports them."""
    if name in HF_TOP:
        return HF_TOP[name]
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in HF_LAYER:
        return f"layers.{parts[2]}.{HF_LAYER[parts[3]]}"
    return name


def model_config_from_hf(hf: dict) -> ModelConfig:
    """A ModelConfig from a LlamaForCausalLM config.json; refuses what sixfold cannot represent."""
    if hf.get("model_type") != "llama":
        raise ConfigError(f"model_type={hf.get('model_type')!r}: only 'llama' models can be imported")
    if hf.get("rope_scaling"):
        raise ConfigError(f"rope_scaling={hf['rope_scaling']!r}: sixfold supports only plain RoPE")
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"rope_parameters.rope_type={rope['rope_type']!r}: sixfold supports only plain RoPE")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConfigError(f"{flag}=true: sixfold's linear layers have no bias")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act={hf['hidden_act']!r}: sixfold's MLP uses silu (SwiGLU)")
    try:
        dim, heads = hf["hidden_size"], hf["num_attention_heads"]
        cfg = ModelConfig(
            vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["num_hidden_layers"], n_heads=heads,
            n_kv_heads=hf.get("num_key_value_heads") or heads, ffn_dim=hf["intermediate_size"],
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_seq_len=hf.get("max_position_embeddings", 2048), init_std=float(hf.get("initializer_range", 0.02)))
    except KeyError as e:
        raise ConfigError(f"HF config has no {e.args[0]}") from None
    if hf.get("head_dim") not in (None, cfg.head_dim):
        raise ConfigError(f"head_dim={hf['head_dim']} differs from hidden_size/num_attention_heads="
                          f"{cfg.head_dim}; sixfold derives head_dim from those")
    return cfg


def hf_config_from_model(cfg: ModelConfig) -> dict:
    """config.json for a LlamaForCausalLM equal to a sixfold Llama."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def expected_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    with torch.device("meta"):
        return {k: v.shape for k, v in Llama(cfg).state_dict().items()}


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
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        if not (hf_dir / shard).is_file():
            raise CheckpointError(f"{index} names shard {shard}, which is missing")
        tensors.update(_read_safetensors(hf_dir / shard))
    return tensors


def import_hf(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Turn a LlamaForCausalLM directory into a sixfold checkpoint (fp32) at out_dir."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise CheckpointError(f"{hf_dir} has no config.json; give a directory written by save_pretrained")
    model_cfg = model_config_from_hf(json.loads((hf_dir / "config.json").read_text()))
    cfg = Config(model=model_cfg)
    cfg.train.seq_len = min(cfg.train.seq_len, model_cfg.max_seq_len)
    config_from_dict(cfg.to_dict())  # validates the imported shape
    tensors = {sixfold_name(k): v.float() for k, v in read_hf_weights(hf_dir).items()
               if not k.endswith("rotary_emb.inv_freq")}
    if model_cfg.tie_embeddings:
        tensors.pop("head.weight", None)
    check_shapes(expected_shapes(model_cfg), tensors, str(hf_dir))
    meta = {"step": 0, "config": cfg.to_dict(), "source": f"import-hf {hf_dir}"}
    return write_checkpoint(out_dir, {"model.safetensors": tensors}, meta)


def load_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[Llama, Config]:
    """A sixfold Llama (fp32) and its Config from a checkpoint or run directory."""
    path = find_checkpoint(path)
    cfg = config_from_dict(read_meta(path)["config"])
    tensors = read_tensors(path, "model.safetensors")
    check_shapes(expected_shapes(cfg.model), tensors, str(path / "model.safetensors"))
    with torch.device("meta"):
        model = Llama(cfg.model)
    model.load_state_dict({k: v.float() for k, v in tensors.items()}, assign=True)
    return model.to(device), cfg


def export_hf(path: str | Path, out_dir: str | Path) -> Path:
    """Write a sixfold checkpoint as a LlamaForCausalLM directory (config.json, model.safetensors)."""
    model, cfg = load_model(path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(hf_config_from_model(cfg.model), indent=2))
    tensors = {hf_name(k): v.contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
