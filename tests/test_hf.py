"""Hugging Face interop: imported and exported models give the same logits as transformers."""
import json
import math
import re
import warnings
from dataclasses import replace
from functools import partial

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sixfold.checkpoint import Checkpoint, CheckpointError, opened, write_checkpoint
from sixfold.config import Config, ConfigError, DataConfig, ModelConfig, load_config
from sixfold.corpus import iter_documents, split_documents
from sixfold.data import BPETokenizer, DataError, load_data
from sixfold.generate import checkpoint_tokenizer, continued, prompt_ids
from sixfold.model.hf import (carried_files, end_ids, export_hf, hf_config_from_model, import_hf, load_model,
                              model_config_from_hf)
from sixfold.model.llama import Llama, init_weights, rope_frequencies
from sixfold.train import train
from helpers import TINY, sixfold

TOL = 1e-5


def perturbed(model):
    """The model with its weights moved off their init (norms by more), so mismatched names or layouts show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.05))
    return model


def hf_model(tied: bool, **extra) -> LlamaForCausalLM:
    cfg = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=320, rope_theta=500000.0, rms_norm_eps=1e-5,
                      max_position_embeddings=128, tie_word_embeddings=tied, attn_implementation="eager", **extra)
    torch.manual_seed(0)
    return perturbed(LlamaForCausalLM(cfg).float().eval())


def tokens() -> torch.Tensor:
    return torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("sharded", [False, True])
def test_import_matches_transformers(tmp_path, tied, sharded):
    hf = hf_model(tied)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="60KB" if sharded else "1GB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file() == sharded
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    model, cfg = load_model(tmp_path / "ckpt")
    assert cfg.model.tie_embeddings == tied and cfg.model.rope_theta == 500000.0
    assert (model.head is None) == tied
    with torch.no_grad():
        assert max_diff(model(tokens()), hf(tokens()).logits) <= TOL
    with pytest.raises(DataError, match="imported from Hugging Face without a tokenizer"):
        checkpoint_tokenizer(tmp_path / "ckpt", cfg)  # not the byte tokenizer its default config names


@pytest.mark.parametrize("tied", [False, True])
def test_export_loads_in_transformers(tmp_path, tied):
    cfg = Config(model=ModelConfig(tie_embeddings=tied, rope_theta=500000.0, max_seq_len=128))
    model = Llama(cfg.model)
    init_weights(model, seed=3)
    perturbed(model)
    write_checkpoint(tmp_path / "ckpt", {"model": model.state_dict()}, {"step": 7, "config": cfg.to_dict()})
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    hf, info = LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager",
                                                output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert hf.config.tie_word_embeddings == tied
    assert (hf.config.bos_token_id, hf.config.eos_token_id) == (None, 256)  # the byte tokenizer's end-of-text
    assert (tmp_path / "hf/model.safetensors").stat().st_mode == (tmp_path / "hf/config.json").stat().st_mode
    with torch.no_grad():
        assert max_diff(model(tokens()), hf.eval()(tokens()).logits) <= TOL


def test_bf16_export_in_shards_loads_in_transformers_and_imports_back(tmp_path):
    """--dtype bf16 halves the files; above the shard size the weights are split with an index, as save_pretrained
    does (its own limit is 5 GB: 64 KB here)."""
    cfg = Config(model=ModelConfig(max_seq_len=128))
    model = Llama(cfg.model)
    init_weights(model, seed=3)
    write_checkpoint(tmp_path / "ckpt", {"model": model.state_dict()}, {"step": 7, "config": cfg.to_dict()})
    export_hf(tmp_path / "ckpt", tmp_path / "hf", dtype="bf16", shard_bytes=2**16)
    shards = sorted((tmp_path / "hf").glob("model-*-of-*.safetensors"))
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(shards) > 1 and set(index["weight_map"].values()) == {p.name for p in shards}
    assert index["metadata"]["total_size"] == sum(p.numel() * 2 for p in model.parameters())
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    assert hf.dtype == torch.bfloat16
    import_hf(tmp_path / "hf", tmp_path / "back")
    back, _ = load_model(tmp_path / "back")
    for name, w in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], w.bfloat16().float()), name
    with pytest.raises(CheckpointError, match="cannot export as 'fp16': choose one of fp32, bf16"):
        export_hf(tmp_path / "ckpt", tmp_path / "fp16", dtype="fp16")


@pytest.mark.parametrize("rope", [{}, {"rope_scaling": "linear", "rope_factor": 4.0},
                                  {"rope_scaling": "llama3", "rope_factor": 32.0, "rope_low_freq": 1.0,
                                   "rope_high_freq": 4.0, "rope_original_len": 8192}])
def test_config_round_trip(rope):
    cfg = ModelConfig(vocab_size=300, dim=96, n_layers=3, n_heads=6, n_kv_heads=3, ffn_dim=256, rope_theta=5e5,
                      norm_eps=1e-6, tie_embeddings=True, max_seq_len=512, init_std=0.01, **rope)
    assert model_config_from_hf(hf_config_from_model(cfg)) == cfg


@pytest.mark.parametrize("kind", ["linear", "llama3"])
def test_rope_scaling_imports_and_exports_as_in_transformers(tmp_path, kind):
    """Llama 3.1 on stretch RoPE's low frequencies (llama3), older models all of them (linear); with original
    length 64 each of llama3's bands holds some of a head's 8 frequencies: kept (wavelength up to 64 / 4), blended,
    divided by the factor (from 64 / 1 up)."""
    bands = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    scaling = {"rope_type": kind, "factor": 8.0, **(bands if kind == "llama3" else {})}
    hf = hf_model(False, rope_scaling=scaling)
    hf.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    model, cfg = load_model(tmp_path / "ckpt")
    assert (cfg.model.rope_scaling, cfg.model.rope_factor, cfg.model.rope_theta) == (kind, 8.0, 500000.0)
    wavelengths = 2 * math.pi / rope_frequencies(ModelConfig(**{**cfg.model.__dict__, "rope_scaling": "none"}))
    assert all(band.any() for band in (wavelengths <= 16, (wavelengths > 16) & (wavelengths < 64), wavelengths >= 64))
    plain = Llama(ModelConfig(**{**cfg.model.__dict__, "rope_scaling": "none"}))
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        expected = hf(tokens()).logits
        assert max_diff(model(tokens()), expected) <= TOL < max_diff(plain(tokens()), expected)
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    back = LlamaForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    with torch.no_grad():
        assert max_diff(back(tokens()).logits, expected) <= TOL


def test_a_rope_scaling_beside_rope_parameters_is_read_as_transformers_reads_it(tmp_path):
    """transformers 5 writes rope_parameters; a rope_scaling added to such a config.json (to extend the context)
    replaces it whole when transformers loads the model, so it must here too: scaled, or refused if unknown."""
    hf = tmp_path / "hf"
    hf_model(False).save_pretrained(hf)
    config = json.loads((hf / "config.json").read_text())
    assert config.get("rope_parameters") and not config.get("rope_scaling")
    (hf / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}))
    expected = LlamaForCausalLM.from_pretrained(hf, attn_implementation="eager").eval()
    import_hf(hf, tmp_path / "ckpt")
    model, cfg = load_model(tmp_path / "ckpt")
    assert (cfg.model.rope_scaling, cfg.model.rope_factor) == ("linear", 4.0)
    with torch.no_grad():
        assert max_diff(model(tokens()), expected(tokens()).logits) <= TOL
    for scaling, said in (({"rope_type": "yarn", "factor": 4.0}, "rope_type='yarn'"),
                          ({"rope_type": "linear"}, "rope_type='linear' without factor")):
        with pytest.raises(ConfigError, match=said):
            model_config_from_hf({**config, "rope_scaling": scaling})


def test_a_tied_model_is_read_from_whichever_name_holds_its_one_copy(tmp_path):
    """transformers loads a tied model stored with lm_head.weight alone (its embedding is that tensor)."""
    from safetensors.torch import load_file, save_file
    hf = hf_model(True)
    hf.save_pretrained(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    stored = load_file(weights)
    stored["lm_head.weight"] = stored.pop("model.embed_tokens.weight")
    save_file(stored, weights, {"format": "pt"})
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    model, _ = load_model(tmp_path / "ckpt")
    with torch.no_grad():
        assert max_diff(model(tokens()), hf(tokens()).logits) <= TOL


def test_a_sliding_window_is_refused_for_mixtral_only():
    """transformers' Llama has no sliding window and ignores the field; Mixtral's attention uses it where it is
    shorter than the context (max_position_embeddings=2048 here)."""
    llama = {**hf_config_from_model(ModelConfig()), "sliding_window": 1024}
    assert model_config_from_hf(llama) == model_config_from_hf({**llama, "sliding_window": None})
    mixtral = hf_config_from_model(ModelConfig(moe_experts=4, moe_top_k=2))
    with pytest.raises(ConfigError, match="sliding_window=1024 is shorter than max_position_embeddings=2048"):
        model_config_from_hf({**mixtral, "sliding_window": 1024})
    assert model_config_from_hf({**mixtral, "sliding_window": 2048}) == model_config_from_hf(mixtral)
    assert model_config_from_hf({**llama, "sliding_window": "none"}) == model_config_from_hf(llama)  # not read
    with pytest.raises(ConfigError, match="sliding_window='none' must be an integer"):
        model_config_from_hf({**mixtral, "sliding_window": "none"})


def test_a_mixtrals_router_jitter_is_imported_with_a_warning():
    """transformers jitters the router's input in training; sixfold does not: the import says so."""
    mixtral = hf_config_from_model(ModelConfig(moe_experts=4, moe_top_k=2))
    with pytest.warns(UserWarning, match="router_jitter_noise=0.01: .* sixfold's routers train without noise"):
        assert model_config_from_hf({**mixtral, "router_jitter_noise": 0.01}) == model_config_from_hf(mixtral)
    with pytest.raises(ConfigError, match="router_jitter_noise='x' must be a number"):
        model_config_from_hf({**mixtral, "router_jitter_noise": "x"})


@pytest.mark.parametrize("field,value", [
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}),
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
    ("attention_bias", True),
    ("mlp_bias", True),
    ("hidden_act", "gelu"),
    ("head_dim", 32),
    ("model_type", "mistral"),
    ("quantization_config", {"quant_method": "fp8", "weight_block_size": [128, 128]}),
])
def test_unrepresentable_config_is_refused(field, value):
    hf = {**hf_config_from_model(ModelConfig()), field: value}
    with pytest.raises(ValueError, match=field):
        model_config_from_hf(hf)


def test_swish_is_imported_as_the_silu_it_is(tmp_path):
    """transformers computes hidden_act="swish" as silu."""
    hf = hf_model(False, hidden_act="swish")
    hf.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    model, _ = load_model(tmp_path / "ckpt")
    with torch.no_grad():
        assert max_diff(model(tokens()), hf(tokens()).logits) <= TOL


@pytest.mark.parametrize("moe,field,value,said", [
    (0, "num_key_value_heads", 3, "num_attention_heads=4 is not divisible by num_key_value_heads=3: set "
                                  "num_key_value_heads to one of 1, 2, 4"),
    (4, "num_experts_per_tok", 5, "num_experts_per_tok=5 must be between 1 and num_local_experts=4"),
])
def test_a_shape_sixfold_cannot_build_is_refused_in_config_jsons_names(tmp_path, moe, field, value, said):
    hf = {**hf_config_from_model(ModelConfig(n_heads=4, n_kv_heads=2, moe_experts=moe, moe_top_k=min(moe, 2))),
          field: value}
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'hf' / 'config.json'}: {said}")):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")


def test_import_refuses_bias_model(tmp_path):
    hf_model(False, attention_bias=True).save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="attention_bias"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")


def test_import_missing_files(tmp_path):
    (tmp_path / "hf").write_text("")
    with pytest.raises(CheckpointError, match="hf is not a directory"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")
    (tmp_path / "hf").unlink()
    (tmp_path / "hf").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config_from_model(ModelConfig())))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")


def test_a_malformed_hf_directory_is_refused_naming_the_file(tmp_path):
    hf = tmp_path / "hf"
    hf_model(False).save_pretrained(hf)
    config = json.loads((hf / "config.json").read_text())
    for text, message in (("[1, 2]", "config.json holds a JSON list, not an object"),
                          ("{not json", "config.json is not readable JSON"),
                          (b"{\"a\": \"\xe9\"}", "config.json is not readable JSON: 'utf-8' codec"),
                          (json.dumps({**config, "num_hidden_layers": "2"}),
                           "config.json's num_hidden_layers='2' must be an integer")):
        (hf / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises((CheckpointError, ValueError), match=message):
            import_hf(hf, tmp_path / "ckpt")
    (hf / "config.json").write_text(json.dumps(config))
    (hf / "model.safetensors").rename(hf / "model-00001-of-00001.safetensors")
    (hf / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="model.safetensors.index.json has no 'weight_map' object"):
        import_hf(hf, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_config_json_numbers_of_the_wrong_type_are_refused_naming_the_file(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    for key, value, message in (("rms_norm_eps", "abc", "'s rms_norm_eps='abc' must be a number"),
                                ("initializer_range", "x", "'s initializer_range='x' must be a number"),
                                ("rope_theta", "big", "'s rope_theta='big' must be a number"),
                                ("rope_theta", True, "'s rope_theta=True must be a number"),
                                ("vocab_size", None, " has no value for vocab_size")):
        (hf / "config.json").write_text(json.dumps({**hf_config_from_model(ModelConfig()), key: value}))
        with pytest.raises(ConfigError, match=re.escape(f"{hf / 'config.json'}{message}")):
            import_hf(hf, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_null_in_config_json_is_transformers_default():
    given = hf_config_from_model(ModelConfig(norm_eps=1e-5, init_std=0.01))
    cfg = model_config_from_hf({**given, "rms_norm_eps": None, "initializer_range": None, "rope_theta": None})
    assert (cfg.norm_eps, cfg.init_std, cfg.rope_theta) == (1e-6, 0.02, 10000.0)  # LlamaConfig's


def test_shape_mismatch_is_refused(tmp_path):
    hf_model(False).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.\w+_proj\.weight has shape"):  # its names
        import_hf(tmp_path / "hf", tmp_path / "ckpt")
    from safetensors.torch import load_file, save_file
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    weights = tmp_path / "hf" / "model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if k != "lm_head.weight"}, weights, {"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing \['lm_head.weight'\]"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")

    wrong = Llama(ModelConfig(vocab_size=256))
    write_checkpoint(tmp_path / "ckpt", {"model": wrong.state_dict()},
                     {"step": 0, "config": Config().to_dict()})
    with pytest.raises(CheckpointError, match="embed.weight"):
        load_model(tmp_path / "ckpt")


def hf_mixtral(**extra):
    from transformers import MixtralConfig, MixtralForCausalLM
    shape = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 320, "num_local_experts": 4, "num_experts_per_tok": 2}
    cfg = MixtralConfig(**{**shape, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "sliding_window": None,
                           "attn_implementation": "eager", **extra})
    torch.manual_seed(0)
    return perturbed(MixtralForCausalLM(cfg).float().eval())


def test_mixtral_import_and_export_match_transformers(tmp_path):
    from transformers import MixtralForCausalLM
    hf = hf_mixtral()
    hf.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    model, cfg = load_model(tmp_path / "ckpt")
    assert (cfg.model.moe_experts, cfg.model.moe_top_k) == (4, 2)
    with torch.no_grad():
        expected = hf(tokens()).logits
        assert max_diff(model(tokens()), expected) <= TOL
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    back = MixtralForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").float().eval()
    with torch.no_grad():
        assert max_diff(back(tokens()).logits, expected) <= TOL
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))  # experts unsaid
    with pytest.raises(CheckpointError, match="its weights do not match its config.json"):
        import_hf(tmp_path / "hf", tmp_path / "as_llama")


@pytest.mark.parametrize("make", [partial(hf_model, False), hf_mixtral], ids=["llama", "mixtral"])
def test_greedy_generation_is_transformers_token_for_token(tmp_path, make):
    """An imported model's greedy tokens through the KV cache are transformers' generate(do_sample=False)'s, to
    max_seq_len (a wide init peaks the logits, so no argmax is decided by rounding)."""
    from sixfold.generate import generate
    hf = make(initializer_range=0.3, eos_token_id=None)
    hf.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    prompt = tokens()[0, :12].tolist()
    ours = generate(load_model(tmp_path / "ckpt")[0], prompt, 200)
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=116, do_sample=False)[0, 12:].tolist()
    assert len(ours) == 116 and ours == theirs


def test_mixtral_balancing_loss_weighs_as_in_transformers(tmp_path):
    """transformers takes the balancing loss once over all layers' routing, sixfold adds each layer's, so
    model.moe_aux_weight is router_aux_loss_coef over the layers, both ways; Mixtral has no router z-loss, so its
    weight is 0. With the routers at zero every
    expert's probability is 1/E: transformers' loss is k, sixfold's k in each of the 3 layers."""
    hf = hf_mixtral(num_hidden_layers=3, router_aux_loss_coef=0.03, output_router_logits=True)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight.zero_()
    hf.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    model, cfg = load_model(tmp_path / "ckpt")
    assert cfg.model.moe_aux_weight == 0.01 and cfg.model.moe_z_weight == 0  # Mixtral has no z-loss
    balancing = Llama(cfg.model)
    balancing.load_state_dict(model.state_dict())
    balancing.loss_sum(tokens(), tokens())
    ours = sum(float(layer.mlp.aux) for layer in balancing.layers.values())
    assert math.isclose(ours, 0.03 * float(hf(tokens(), labels=tokens()).aux_loss), rel_tol=1e-6)
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["router_aux_loss_coef"] == 0.03


@pytest.mark.parametrize("left_out", ["rope_parameters", "rms_norm_eps"])
def test_mixtral_settings_left_out_of_config_json_are_mixtrals_defaults(tmp_path, left_out):
    """transformers reads a config.json without them with MixtralConfig's defaults (rope_theta 1e6, rms_norm_eps
    1e-5), not LlamaConfig's."""
    hf = hf_mixtral()
    hf.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.pop(left_out)
    config.pop("rope_theta", None)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    model, _ = load_model(tmp_path / "ckpt")
    with torch.no_grad():
        assert max_diff(model(tokens()), hf(tokens()).logits) <= TOL


def test_fine_tuning_an_imported_model_with_other_settings_or_the_byte_tokenizer_warns(tmp_path):
    """A weights-only checkpoint may be trained on with other model settings, but one that changes what the
    weights compute (rope_theta here) is named; so is a tokenizer that is not a tokenizer.json (the model was
    imported without one). A setting not given is the checkpoint's: no warning."""
    hf_model(False).save_pretrained(tmp_path / "hf")
    with pytest.warns(UserWarning, match=r"hf has no tokenizer.json: the checkpoint holds no tokenizer"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")
    BPETokenizer.train(["def f(x):\n    return x\n"] * 20, 300).save(tmp_path / "tokenizer.json")
    common = [f"checkpoint.resume={tmp_path / 'ckpt'}", "train.steps=1", "checkpoint.every=0",
              "checkpoint.save_final=false"]
    with pytest.warns(UserWarning) as said:
        train(load_config(TINY, [*common, f"log.run_dir={tmp_path / 'a'}", "model.rope_theta=10000"]))
    said = [str(w.message) for w in said]
    assert any(re.match(r"this run has model.rope_theta=10000.0 \(the checkpoint's: 500000.0\): the weights of "
                        r".*ckpt compute another function with them", s) for s in said), said
    assert any(re.match(r".*ckpt holds weights imported from Hugging Face without their tokenizer, and "
                        r"data.tokenizer=byte gives their token ids other meanings", s) for s in said), said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(load_config(TINY, [*common, f"log.run_dir={tmp_path / 'b'}",
                                 f"data.tokenizer={tmp_path / 'tokenizer.json'}", f"data.cache_dir={tmp_path / 'c'}"]))


def test_the_model_settings_not_given_are_those_of_the_checkpoint_a_run_starts_from(tmp_path):
    """A model imported from Hugging Face is trained on without restating its shape: the model.* settings that
    neither the config file nor an override gives are the checkpoint's (checkpoint.resume=auto: the run
    directory's), but for how a step computes (recompute, loss_chunk); those given win."""
    hf_model(False).save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    saved = load_model(tmp_path / "ckpt")[1].model
    assert saved != ModelConfig() and saved.rope_theta == 500000.0
    resume = f"checkpoint.resume={tmp_path / 'ckpt'}"
    assert load_config(None, [resume]).model == saved
    assert load_config(None, [resume, "model.max_seq_len=64"]).model == replace(saved, max_seq_len=64)
    (tmp_path / "tune.yaml").write_text(f"model: {{max_seq_len: 64}}\ncheckpoint: {{resume: {tmp_path / 'ckpt'}}}\n")
    assert load_config(tmp_path / "tune.yaml").model == replace(saved, max_seq_len=64)
    run = tmp_path / "run"
    train(load_config(TINY, [f"log.run_dir={run}", "train.steps=1", "model.dim=32", "model.recompute=full"]))
    resumed = load_config(None, [f"log.run_dir={run}", "checkpoint.resume=auto"]).model
    assert resumed.dim == 32 and resumed.recompute == "none"
    assert load_config(None, [f"log.run_dir={tmp_path / 'new'}", "checkpoint.resume=auto"]).model == ModelConfig()


def llama2_style_tokenizer(specials: list[str], template: str | None = None) -> str:
    """A tokenizer.json whose end of text is a special token other than <|endoftext|> (as Llama 2's </s>); with a
    template ("<s> $A") that encodes a text with special tokens around it, as transformers' tokenizers do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20, trainer)
    if template:
        tok.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[(t, tok.token_to_id(t)) for t in specials if t in template])
    return tok.to_str()


@pytest.mark.parametrize("template", ["<|begin_of_text|> $A", "<|begin_of_text|> $A <|end_of_text|>"])
def test_a_start_token_begins_every_document_and_prompt_as_transformers_encodes_a_text(tmp_path, template):
    """Llama 3's tokenizer.json puts <|begin_of_text|> before a text: so does sixfold, before each document of the
    token stream and before a prompt, but not the end of text a template may put after it (each document is
    followed by one already). A sample's text does not show the start token."""
    from transformers import PreTrainedTokenizerFast
    (tmp_path / "tok.json").write_text(llama2_style_tokenizer(["<|begin_of_text|>", "<|end_of_text|>"], template))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tok.json"))
    docs = {"a.txt": "def f(x):\n", "b.txt": "    return x + 1\n", "c.txt": "def g(y): return y\n"}
    for name, text in docs.items():
        (tmp_path / "corpus").mkdir(exist_ok=True)
        (tmp_path / "corpus" / name).write_text(text)
    cfg = DataConfig(source=str(tmp_path / "corpus"), tokenizer=str(tmp_path / "tok.json"),
                     cache_dir=str(tmp_path / "cache"), val_fraction=0.5)
    data = load_data(cfg)
    tok = data.tokenizer
    assert tok.start == (0,) and tok.start_token == "<|begin_of_text|>" and tok.eot == 1
    end = [1] if template.endswith("<|end_of_text|>") else []
    assert all(hf(text)["input_ids"] == tok.encode(text) + end for text in docs.values())
    train_docs, val_docs = split_documents(iter_documents(cfg), 0.5)
    for stream, part in [(data.train, train_docs), (data.val, val_docs)]:
        assert stream.tolist() == [i for _, text in part for i in tok.encode(text) + [1]] and stream[0] == 0
    assert continued(tok, "def f", tok.encode("def f"), tok.encode("(x)")[1:]) == "def f(x)"
    marked = "def<|end_of_text|>f"  # a special token's text: in a prompt that token, in a document text
    assert 1 in prompt_ids(tok, marked) and hf(marked)["input_ids"] == prompt_ids(tok, marked) + end
    assert 1 not in tok.encode(marked)


def test_a_prompt_and_answer_are_encoded_whole_with_their_chat_markers(tmp_path):
    """A JSON line of prompt and answer is encoded as transformers encodes their text together (a special token's
    text as that token, as a chat template writes it); the tokens that begin in the prompt are the prompt's."""
    from transformers import PreTrainedTokenizerFast
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    (tmp_path / "tok.json").write_text(llama2_style_tokenizer(specials, "<|begin_of_text|> $A"))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tok.json"))
    prompt, answer = "def f(x):<|eot_id|>", "    return x + 1\n<|eot_id|>"
    (tmp_path / "qa.jsonl").write_text(json.dumps({"prompt": prompt, "answer": answer}) + "\n" * 2)
    data = load_data(DataConfig(source=str(tmp_path / "qa.jsonl"), tokenizer=str(tmp_path / "tok.json"),
                                jsonl_field="answer", jsonl_prompt_field="prompt", cache_dir=str(tmp_path / "c")))
    whole, head = hf(prompt + answer)["input_ids"], hf(prompt)["input_ids"]
    assert 2 in head and whole[-1] == 2  # <|eot_id|> as the token
    stream = [i + data.shift for i in whole[:len(head)]] + whole[len(head):] + [1]
    assert (data.train.tolist() + data.val.tolist()) == stream


def test_prompts_that_begin_with_the_start_token_are_named(tmp_path):
    """A chat template's output begins with <|begin_of_text|>, which the tokenizer puts before each text again."""
    (tmp_path / "tok.json").write_text(llama2_style_tokenizer(["<|begin_of_text|>", "<|end_of_text|>"],
                                                              "<|begin_of_text|> $A"))
    lines = [{"prompt": f"<|begin_of_text|>q{i}" if i % 2 else f"q{i}", "answer": " a"} for i in range(6)]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    cfg = DataConfig(source=str(tmp_path / "qa.jsonl"), tokenizer=str(tmp_path / "tok.json"), jsonl_field="answer",
                     jsonl_prompt_field="prompt", cache_dir=str(tmp_path / "c"))
    for _ in range(2):  # and from the cache
        with pytest.warns(UserWarning, match="3 of 6 prompt\\(s\\) begin with <\\|begin_of_text\\|>, and the "
                                             "tokenizer puts one before each text: those documents begin with it "
                                             "twice"):
            data = load_data(cfg)
    stream, start = data.train.tolist() + data.val.tolist(), data.shift  # <|begin_of_text|>, id 0, a prompt's
    assert sum(a == b == start for a, b in zip(stream, stream[1:])) == 3


def test_a_token_across_the_end_of_a_prompt_is_the_answers(tmp_path):
    """A prompt that ends in a space: byte-level BPE makes " 1" one token, begun in the prompt; it is a target (the
    answer's), so that none of the answer is lost."""
    (tmp_path / "tok.json").write_text(llama2_style_tokenizer(["<s>", "</s>"]))
    tok = BPETokenizer.from_file(tmp_path / "tok.json")
    prompt, answer = "def f(x):\n    return x + ", "1\n"
    [(ids, n)] = tok.encode_prompted([(prompt + answer, len(prompt))])
    one = tok.encode(" 1")
    assert len(one) == 1 and ids[n:].tolist() == one + tok.encode("\n")


def test_an_imported_models_tokenizer_comes_with_it_to_training_generation_and_export(tmp_path):
    """A tokenizer.json with </s> as its end of text and <s> as its start is carried into the checkpoint: generation
    reads it, training with data.tokenizer=bpe uses it (another tokenizer warns), and export writes it back with
    </s> as the eos and <s> as the bos. The tokenizer's settings (a chat template) and generation's (two end
    tokens, as an instruct model has) come along as they were, into the run's checkpoints and the export."""
    from transformers import AutoTokenizer
    hf_model(False, bos_token_id=0, eos_token_id=[1, 2]).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text(llama2_style_tokenizer(["<s>", "</s>"], "<s> $A"))
    chat = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}))
    (tmp_path / "hf" / "chat_template.jinja").write_text(chat)  # (as transformers 4.43 and later save it)
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    tok = checkpoint_tokenizer(tmp_path / "ckpt", load_model(tmp_path / "ckpt")[1])
    assert tok.eot_token == "</s>" and tok.eot == 1 and tok.start_token == "<s>"
    common = [f"checkpoint.resume={tmp_path / 'ckpt'}", "model.rope_theta=500000", "train.steps=1",
              "checkpoint.every=0", f"data.cache_dir={tmp_path / 'cache'}"]
    with pytest.warns(UserWarning, match=r"ckpt holds the tokenizer its model was imported with, and data.tokenizer="
                                         r"byte gives its token ids other meanings; set data.tokenizer=bpe"):
        train(load_config(TINY, [*common, f"log.run_dir={tmp_path / 'byte'}", "checkpoint.save_final=false"]))
    run = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(load_config(TINY, [*common, f"log.run_dir={run}", "data.tokenizer=bpe"]))  # (no BPE of 2048 trained)
    assert checkpoint_tokenizer(run, load_model(run)[1]).name == tok.name
    export_hf(run, tmp_path / "out")
    back = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert (back.eos_token, back.eos_token_id, back.bos_token, back.bos_token_id) == ("</s>", 1, "<s>", 0)
    assert back("def f(x)")["input_ids"] == tok.encode("def f(x)")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"]) == ([1, 2], 0)
    assert end_ids(carried_files(Checkpoint(run))) == [1, 2]
    assert back.chat_template == chat
    assert back.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "<s>x</s>"
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == [1, 2]


def test_a_missing_directory_or_a_hugging_face_one_given_as_a_checkpoint_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"nowhere does not exist; give a directory written by save_pretrained"):
        import_hf(tmp_path / "nowhere", tmp_path / "ckpt")
    hf_model(False).save_pretrained(tmp_path / "hf")
    with pytest.raises(CheckpointError, match=r"hf is a Hugging Face model directory, not a checkpoint: turn it into "
                                              r"one with `sixfold import-hf .*hf OUT` and give OUT"):
        Checkpoint(tmp_path / "hf")


def test_every_rank_ends_the_sample_at_a_carried_end_token(tmp_path):
    """The sample after training is a collective under tp: every rank must stop at the same token, here at once
    (every token is an end token of the carried generation_config.json)."""
    hf_model(False, eos_token_id=list(range(320))).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text(llama2_style_tokenizer(["<s>", "</s>"]))
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    proc = sixfold("train", TINY, f"checkpoint.resume={tmp_path / 'ckpt'}", f"log.run_dir={tmp_path / 'run'}",
                   "data.tokenizer=bpe", "data.bpe_vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}",
                   "parallel.tp=2", "train.steps=1", "log.sample_tokens=8", "parallel.timeout_s=60", "--nproc", "2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert end_ids(carried_files(Checkpoint(tmp_path / "run"))) == list(range(320))


def test_llama_3s_end_of_text_is_taken_after_its_start_token():
    tok = BPETokenizer.from_json(llama2_style_tokenizer(["<|begin_of_text|>", "<|end_of_text|>"]), "llama3")
    assert tok.eot_token == "<|end_of_text|>" and tok.eot == 1


def _beyond_the_vocabulary(text: str) -> str:
    """The tokenizer.json with its end-of-text token's id moved to 70000 (more than hf_model's 320 tokens)."""
    spec = json.loads(text)
    end = next(t for t in spec["added_tokens"] if t["content"] == "</s>")
    spec["model"]["vocab"]["</s>"] = end["id"] = 70000
    return json.dumps(spec)


def _without_unknown() -> str:
    """A word-level tokenizer.json whose unknown token is not in its vocabulary: it cannot encode 'a'."""
    from tokenizers import Tokenizer, models
    tok = Tokenizer(models.WordLevel({"b": 0, "<|endoftext|>": 1}, unk_token="<unk>"))
    tok.add_special_tokens(["<|endoftext|>"])
    return tok.to_str()


@pytest.mark.parametrize("text, why", [
    (llama2_style_tokenizer(["<unk>"]), "has no end-of-text token"),
    ("{not json", "is not a tokenizers JSON file"),
    (_beyond_the_vocabulary(llama2_style_tokenizer(["<s>", "</s>"])), "its 70001 tokens are more than the model's 320"),
    (_without_unknown(), "cannot encode text"),
], ids=["no end of text", "not a tokenizer", "ids beyond the vocabulary", "cannot encode"])
def test_a_tokenizer_sixfold_cannot_use_is_left_out_of_an_import_with_a_warning(tmp_path, text, why):
    hf_model(False).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text(text)
    with pytest.warns(UserWarning, match=rf"tokenizer.json is not carried over \(.*{why}"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")
    with pytest.raises(DataError, match="imported from Hugging Face without a tokenizer"):
        checkpoint_tokenizer(tmp_path / "ckpt", load_model(tmp_path / "ckpt")[1])


def test_generate_refuses_a_checkpoint_without_its_tokenizer_before_it_reads_the_weights(tmp_path, monkeypatch,
                                                                                          capsys):
    from sixfold import cli
    from sixfold.model import hf
    hf_model(False).save_pretrained(tmp_path / "hf")
    with pytest.warns(UserWarning, match="has no tokenizer.json"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")
    monkeypatch.setattr(hf, "load_model", lambda *args: pytest.fail("the weights were read"))
    assert cli.main(["generate", str(tmp_path / "ckpt"), "--prompt", "a"]) == 2
    assert "imported from Hugging Face without a tokenizer" in capsys.readouterr().err


def test_generate_samples_as_the_checkpoints_generation_config_says_unless_told(tmp_path, monkeypatch, capsys):
    """An instruction-tuned model's generation_config.json samples (do_sample) with its temperature and top_p, and
    transformers' top_k of 50: sixfold generate takes them where no option is given; without do_sample, its own."""
    from sixfold import cli, generate
    from sixfold.model import hf
    hf_model(False).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text(llama2_style_tokenizer(["<s>", "</s>"]))
    drawn = []
    monkeypatch.setattr(generate, "sample_text", lambda *a, top_p: drawn.append((a[4], a[5], top_p)) or "")
    for n, (generation, options, settings) in enumerate([
            ({"do_sample": True, "temperature": 0.6, "top_p": 0.9}, [], (0.6, 50, 0.9)),
            ({"do_sample": True, "temperature": 0.6, "top_p": 0.9}, ["--temperature", "0", "--top-k", "3"],
             (0, 3, 0.9)),
            ({"temperature": 0.6, "top_p": 0.9}, [], (0.8, 40, 1.0))]):
        (tmp_path / "hf" / "generation_config.json").write_text(json.dumps(generation))
        import_hf(tmp_path / "hf", tmp_path / f"ckpt{n}")
        assert cli.main(["generate", str(tmp_path / f"ckpt{n}"), "--prompt", "a", *options]) == 0
        assert drawn.pop() == settings
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": -1}))
    import_hf(tmp_path / "hf", tmp_path / "bad")
    monkeypatch.setattr(hf, "load_model", lambda *args: pytest.fail("the weights were read"))
    assert cli.main(["generate", str(tmp_path / "bad"), "--prompt", "a"]) == 2
    assert "generation_config.json has temperature=-1, which must be 0 (greedy) or a positive number; give " \
           "--temperature" in capsys.readouterr().err


def test_a_bpe_model_exports_a_tokenizer_that_transformers_reads_with_its_eos(tmp_path):
    from transformers import AutoTokenizer
    run = tmp_path / "run"
    train(load_config(TINY, [f"log.run_dir={run}", "train.steps=1", "data.tokenizer=bpe", "data.bpe_vocab_size=300",
                             "data.max_bytes=200000", f"data.cache_dir={tmp_path / 'cache'}"]))
    export_hf(run, tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    eos = json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"]
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == eos
    assert tok.decode(tok("def f(x):")["input_ids"]) == "def f(x):"


def test_a_byte_model_exports_a_tokenizer_that_transformers_reads_as_bytes(tmp_path):
    """A model trained on bytes (data.tokenizer=byte) exports them as a tokenizer.json of byte-level BPE with no
    merges: transformers' ids are the text's UTF-8 bytes and its end of text is 256, the config's eos."""
    from transformers import AutoTokenizer
    cfg = Config(model=ModelConfig(max_seq_len=128))
    write_checkpoint(tmp_path / "ckpt", {"model": Llama(cfg.model).state_dict()}, {"step": 1, "config": cfg.to_dict()})
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def f(x):\n    return 'héllo ✓'"
    assert tok(text)["input_ids"] == list(text.encode("utf-8")) and tok.decode(list(text.encode("utf-8"))) == text
    eos = json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"]
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == eos == 256


def test_a_refused_export_writes_nothing(tmp_path):
    cfg = Config(model=ModelConfig(moe_experts=4, moe_every=2))
    write_checkpoint(tmp_path / "ckpt", {"model": Llama(cfg.model).state_dict()}, {"step": 1, "config": cfg.to_dict()})
    with pytest.raises(ValueError, match="model.moe_every=2"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_import_and_export_write_only_new_directories(tmp_path):
    """Neither replaces what an output path holds (a training checkpoint, another model)."""
    hf_model(tied=True).save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="file is a file"):
        export_hf(tmp_path / "ckpt", tmp_path / "file")
    with pytest.raises(CheckpointError, match="cannot write under .*file/sub.*choose a writable directory"):
        export_hf(tmp_path / "ckpt", tmp_path / "file" / "sub")
    for inside in (tmp_path / "ckpt" / "hf", tmp_path / "ckpt" / "a" / "b"):  # a run's rotation would remove it
        with pytest.raises(CheckpointError, match=f"{inside} is inside {tmp_path / 'ckpt'}, whose contents sixfold's "
                                                  f"checkpoint saves replace and checkpoint.keep removes"):
            export_hf(tmp_path / "ckpt", inside)
    runs = tmp_path / "run" / "checkpoints"
    runs.mkdir(parents=True)
    (runs / "latest").write_text("step_0000001")
    with pytest.raises(CheckpointError, match="write it outside the run's checkpoints/ folder"):
        import_hf(tmp_path / "hf", runs / "imported")


def test_generate_reads_one_checkpoint_while_the_run_saves_another(tmp_path, monkeypatch, capsys):
    """`sixfold generate <run>` on a run that saves meanwhile: the config, tokenizer and weights all come from the
    checkpoint `latest` named when the command began."""
    from sixfold import cli, generate
    from sixfold.model import hf
    run = tmp_path / "run"
    train(load_config(TINY, [f"log.run_dir={run}", "train.steps=2", "checkpoint.every=1"]))
    latest = run / "checkpoints" / "latest"
    second, first = latest.read_text(), sorted(p.name for p in (run / "checkpoints").glob("step*"))[0]
    latest.write_text(first)
    problem, load = generate.prompt_problem, hf.load_model

    def saving(*args):  # the run's next save lands after the config was read
        latest.write_text(second)
        return problem(*args)

    monkeypatch.setattr(generate, "prompt_problem", saving)
    monkeypatch.setattr(hf, "load_model", lambda source, device: (read.append(opened(source).path),
                                                                  load(source, device))[1])
    read = []
    assert cli.main(["generate", str(run), "--prompt", "a", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert [p.name for p in read] == [first] and latest.read_text() == second
