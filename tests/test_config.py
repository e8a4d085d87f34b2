import os
import re

import pytest
import torch

from sixfold.config import ConfigError, load_config, validate


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  dim: 128\n  n_heads: 8\ntrain:\n  lr: 0.01\n")
    cfg = load_config(path, ["train.lr=3e-4", "parallel.dp_replicate=2", "model.tie_embeddings=true"])
    assert cfg.model.dim == 128 and cfg.model.n_heads == 8
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.parallel.dp_replicate == 2 and cfg.model.tie_embeddings is True


def test_text_overrides_are_taken_as_written_and_home_is_expanded_in_paths():
    """YAML would read 0100 as the integer 64 and 12:30 as 750; a path's ~ is the home directory, and spaces
    around a path are dropped (other text keeps them: a prompt's trailing space is part of it)."""
    cfg = load_config(None, ["log.run_dir=runs/0100", "log.sample_prompt=12:30", "checkpoint.resume=~/run",
                             "data.source=~/corpus"])
    assert (cfg.log.run_dir, cfg.log.sample_prompt) == ("runs/0100", "12:30")
    assert cfg.checkpoint.resume == os.path.expanduser("~/run") and not cfg.data.source.startswith("~")
    assert load_config(None, ["log.run_dir=0100"]).log.run_dir == "0100"
    spaced = load_config(None, ["log.run_dir= runs/a ", "log.sample_prompt=def "])
    assert (spaced.log.run_dir, spaced.log.sample_prompt) == ("runs/a", "def ")


def test_unknown_key_names_nearest(tmp_path):
    with pytest.raises(ConfigError, match=r"parallel\.dp_shrd.*dp_shard"):
        load_config(None, ["parallel.dp_shrd=2"])
    with pytest.raises(ConfigError, match="unknown config key 'trian'.*train"):
        load_config(None, ["trian.lr=1"])
    (tmp_path / "run.yaml").write_text("trian:\n  lr: 1\n")  # from a file: the file is named
    with pytest.raises(ConfigError, match=f"^config file {tmp_path / 'run.yaml'}: unknown config key 'trian'; did "
                                          "you mean 'train'\\?"):
        load_config(tmp_path / "run.yaml")
    with pytest.raises(ConfigError, match="'parallel.dp'; did you mean 'parallel.dp_replicate' or 'parallel.dp_shard'"):
        load_config(None, ["parallel.dp=2"])
    with pytest.raises(ConfigError, match="unknown config key 'steps'; did you mean 'train.steps'\\?"):
        load_config(None, ["steps=10"])  # its section left out
    with pytest.raises(ConfigError, match="unknown config key 'train.batch_size'; did you mean 'train.global_batch'"):
        load_config(None, ["train.batch_size=16"])  # another framework's name
    with pytest.raises(ConfigError, match="'train.micro_batches'\\? \\(here: the parts train.global_batch is cut into"):
        load_config(None, ["train.gradient_accumulation_steps=4"])  # theirs multiplies the batch, ours cuts it
    for key, meant in (("max_steps", "train.steps"), ("hidden_size", "model.dim"),
                       ("tensor_model_parallel_size", "parallel.tp")):  # another framework's name, its section left out
        with pytest.raises(ConfigError, match=f"^unknown config key '{key}'; did you mean '{meant}'\\?$"):
            load_config(None, [f"{key}=2"])
    with pytest.raises(ConfigError, match="'batch_size'; did you mean 'train.global_batch'\\? \\(here: the sequences"):
        load_config(None, ["batch_size=16"])
    for key, meant in (("train.tp", "parallel.tp"), ("model.precision", "train.precision"),
                       ("train.resume", "checkpoint.resume")):  # a key of another section
        with pytest.raises(ConfigError, match=f"unknown config key '{key}'; did you mean '{meant}'\\?"):
            load_config(None, [f"{key}=2"])


def test_an_unknown_option_gets_the_commands_usage_and_the_nearest_it_takes(capsys):
    from sixfold.cli import main
    cases = [(["train", "configs/tiny.yaml", "--steps", "3", "train.steps=2"],
              "sixfold train: error: unrecognized option --steps (did you mean the config key train.steps=VALUE?); "
              "sixfold train takes --help, --nproc"),
             (["train", "configs/tiny.yaml", "--nprocs", "2"], "unrecognized option --nprocs (did you mean --nproc?)"),
             (["generate", "runs/x", "--prompt", "a", "--max-tokens=5"],
              "unrecognized option --max-tokens (did you mean --max-new-tokens?)"),
             (["train"], "sixfold train: error: name a config file"),  # not a run of the defaults on the stdlib
             (["check", "configs/tiny.yaml", "train.steps=3", "parallel.tp=2", "train.steps=2"],
              "sixfold check: error: train.steps given more than once; give each key once"),
             (["check", "configs/tiny.yaml", "parallel={tp: 2, zero: 1}", "parallel.tp=4"],
              "sixfold check: error: parallel.tp given more than once; give each key once")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as ended:
            main(argv)
        err = capsys.readouterr().err
        assert ended.value.code == 2 and message in err and err.startswith("usage: sixfold " + argv[0]), err


def test_a_config_path_holding_an_equals_sign_is_read_as_the_config(tmp_path, monkeypatch):
    """A config file named for its setting (lr=3e-4.yaml) was read as an override of a key `lr`."""
    from sixfold.cli import _split
    (tmp_path / "lr=3e-4.yaml").write_text("train: {steps: 7}\n")
    monkeypatch.chdir(tmp_path)
    for path in ("lr=3e-4.yaml", str(tmp_path / "lr=3e-4.yaml")):
        assert _split([path, "train.seq_len=32"]) == (path, ["train.seq_len=32"])
        assert load_config(*_split([path, "train.seq_len=32"])).train.steps == 7
    assert _split(["train.steps=3", "train.seq_len=32"]) == (None, ["train.steps=3", "train.seq_len=32"])
    with pytest.raises(ConfigError, match="config file .*runs/lr=1.yaml"):  # not there: said as a config file
        load_config(*_split(["runs/lr=1.yaml"]))


def test_bad_generate_options_are_refused_before_the_checkpoint_is_read(capsys):
    from sixfold.cli import main
    cases = [(["--temperature", "-1"], "argument --temperature: -1 must be 0 (greedy) or a positive number"),
             (["--temperature", "nan"], "argument --temperature: nan must be 0 (greedy) or a positive number"),
             (["--top-p", "0"], "argument --top-p: 0 must be above 0 and at most 1 (1: every token)"),
             (["--top-p", "1.5"], "argument --top-p: 1.5 must be above 0 and at most 1 (1: every token)"),
             (["--seed", "-1"], "argument --seed: -1 must be at least 0"),
             (["--seed", str(2**63)], f"argument --seed: {2**63} must be from 0 to 2**63 - 1"),
             (["--device", "gpu"], "argument --device: 'gpu' is not a device: give cpu, cuda or cuda:N"),
             (["--device", "meta"], "argument --device: meta: give cpu, cuda or cuda:N"),
             (["--device", f"cuda:{torch.cuda.device_count()}"],
              f"argument --device: cuda:{torch.cuda.device_count()}: this machine has {torch.cuda.device_count()} "
              f"CUDA device(s); give cpu")]
    for options, message in cases:
        with pytest.raises(SystemExit) as ended:  # (runs/nowhere is not there: not read)
            main(["generate", "runs/nowhere", "--prompt", "a", *options])
        err = capsys.readouterr().err
        assert ended.value.code == 2 and f"sixfold generate: error: {message}" in err, err


def test_unknown_key_in_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  n_layer: 3\n")
    with pytest.raises(ConfigError, match="model.n_layer.*n_layers"):
        load_config(path)


def test_an_empty_section_changes_nothing(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\ntrain: {steps: 3}\n")
    cfg = load_config(path)
    assert cfg.model == load_config(None).model and cfg.train.steps == 3
    with pytest.raises(ConfigError, match="'model' is a section; give it a mapping"):
        load_config(None, ["model=3"])


def test_a_files_values_are_read_as_written_then_by_their_settings_type(tmp_path):
    """Not by YAML 1.1's types (0755 an octal 493, no and on booleans), as overrides are; merge keys and null work."""
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  <<: {steps: 3, lr: 0.01}\n  steps: 010\nlog: {run_dir: 0755, sample_prompt: no}\n"
                    "data: {jsonl_field: on}\nparallel: {reshard_after_forward: ~}\nmodel: {tie_embeddings: yes}\n"
                    "checkpoint: {save_final: off, async_save: On}\n")
    cfg = load_config(path, check=False)
    assert (cfg.train.steps, cfg.train.lr, cfg.log.run_dir, cfg.log.sample_prompt) == (10, 0.01, "0755", "no")
    assert (cfg.data.jsonl_field, cfg.parallel.reshard_after_forward, cfg.model.tie_embeddings) == ("on", None, True)
    assert (cfg.checkpoint.save_final, cfg.checkpoint.async_save) == (False, True)  # YAML 1.1's on and off too
    cfg = load_config(None, ["parallel.reshard_after_forward=off", "log.trace=ON"], check=False)
    assert (cfg.parallel.reshard_after_forward, cfg.log.trace) == (False, True)


def test_integers_as_python_writes_them():
    """A sign and digit groups (`+5`, `1_000`) read as int() reads them; a float reads them too."""
    cfg = load_config(None, ["train.steps=+5", "train.global_batch=1_024", "train.lr=1_0e-4"], check=False)
    assert (cfg.train.steps, cfg.train.global_batch, cfg.train.lr) == (5, 1024, 1e-3)


def test_bad_values(tmp_path):
    with pytest.raises(ConfigError, match="train.steps must be an integer"):
        load_config(None, ["train.steps=abc"])
    with pytest.raises(ConfigError, match="train.lr must be a number, got 'true'"):
        load_config(None, ["train.lr=true"])
    for value in ("--5", "²", "1:30", "1__000", "_1", "1.0"):
        with pytest.raises(ConfigError, match=f"train.steps must be an integer, got '{value}'"):
            load_config(None, [f"train.steps={value}"])
    with pytest.raises(ConfigError, match="train.steps must be an integer of at most 4300 digits"):
        load_config(None, ["train.steps=" + "9" * 5000])
    listed = tmp_path / "listed.yaml"
    listed.write_text("data: {source: [a, b]}\n")
    with pytest.raises(ConfigError, match=re.escape("data.source must be text, got ['a', 'b']")):
        load_config(listed)
    with pytest.raises(ConfigError, match="the config file's path is empty: give a YAML file"):
        load_config("")
    with pytest.raises(ConfigError, match="data.jsonl_field is empty: name the field"):
        load_config(None, ["data.jsonl_field="])
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\x00\x01\xff\xfe")
    with pytest.raises(ConfigError, match=f"config file {binary} is not UTF-8 text"):
        load_config(binary)
    with pytest.raises(ConfigError, match=re.escape("model.tie_embeddings must be true or false (or yes/no, on/off, "
                                                    "1/0), got 'maybe'")):
        load_config(None, ["model.tie_embeddings=maybe"])
    with pytest.raises(ConfigError, match="^parallel.reshard_after_forward must be true, false or null \\(unset\\), "
                                          "got 'None'$"):  # Python's spelling of null
        load_config(None, ["parallel.reshard_after_forward=None"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent.yaml")
    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a directory: give a YAML file"):
        load_config(tmp_path)
    twice = tmp_path / "twice.yaml"
    twice.write_text("model: {dim: 64}\ntrain: {steps: 3}\nmodel: {dim: 128}\n")
    with pytest.raises(ConfigError, match="is not valid YAML: key 'model' is given twice\n.*line 3"):
        load_config(twice)
    with pytest.raises(ConfigError, match=r"train.seed=100000000000000000000000 must be from 0 to 2\*\*63 - 1"):
        load_config(None, ["train.seed=100000000000000000000000"])


@pytest.mark.parametrize("overrides, message", [
    (["model.n_heads=3"], "model.dim=64 is not divisible by model.n_heads=3: set model.dim to 60 or 66, or "
                          "model.n_heads to one of 1, 2, 4, 8, 16, 32"),
    (["model.dim=65"], "model.dim=65 is not divisible by model.n_heads=4: set model.dim to 64 or 72$"),
    (["model.n_kv_heads=3"], "model.n_heads=4 is not divisible by model.n_kv_heads=3: set model.n_kv_heads to one "
                             "of 1, 2, 4"),
    (["parallel.dp_replicate=3"], "train.global_batch=8 must be divisible by data-parallel size .*: set "
                                  "train.global_batch to a multiple of 3 \\(such as 9\\)$"),
    (["train.micro_batches=3"], "train.global_batch=8 must be divisible .*: set train.global_batch to a multiple of 3 "
                                "\\(such as 9\\), or train.micro_batches to one of 1, 2, 4, 8"),
    (["parallel.cp=2", "train.seq_len=30"], "train.seq_len=30 must be divisible by 4: set it to 28 or 32 "
                                            "\\(2 \\* parallel.cp, the zigzag chunks of a sequence; or set "
                                            "parallel.cp_zigzag=false\\)"),
    (["parallel.cp=8", "parallel.cp_mode=ulysses"], "the 4 query head\\(s\\) per tp rank must be divisible by "
                                                    "parallel.cp=8"),
    (["parallel.cp=2", "parallel.cp_mode=rings"], "parallel.cp_mode='rings': choose ring, allgather or ulysses"),
    (["parallel.tp=2", "train.seq_len=31"], "train.seq_len=31 must be divisible by parallel.tp=2"),
    (["parallel.tp=8", "model.n_heads=4"], "model.n_heads=4 is not divisible by parallel.tp=8: set parallel.tp to "
                                           "one of 1, 2, 4"),
    (["model.dim=60"], "head dimension 15 .* must be even for RoPE: change model.dim or model.n_heads"),
    (["parallel.tp=4", "model.ffn_dim=170"], "model.ffn_dim=170 is not divisible by parallel.tp=4: set it to 168 or "
                                             "172"),
    (["parallel.tp=2", "model.n_heads=6", "model.dim=96", "model.n_kv_heads=3"],
     "model.n_kv_heads=3 and parallel.tp=2: one must divide the other .*; set parallel.tp to one of 1, 3, 6"),
    (["parallel.ep=2"], "parallel.ep=2 splits a model's experts, and this model has none"),
    (["model.moe_experts=-1"], "model.moe_experts=-1 must be 0 \\(a dense model\\) or more"),
    (["model.moe_experts=4", "model.moe_every=0"], "model.moe_every=0 must be at least 1"),
    (["model.moe_experts=4", "model.moe_top_k=5"], "model.moe_top_k=5 must be between 1"),
    (["train.seq_len=4096"], "exceeds model.max_seq_len"),
    (["data.format=parquet"], "data.format"),
    (["parallel.zero=4"], "parallel.zero=4: choose 0"),
    (["parallel.dp_shard=2", "parallel.zero=2", "parallel.reshard_after_forward=true"],
     "parallel.reshard_after_forward=true applies to parallel.zero=3 .* leave it unset"),
    (["parallel.dp_shard=2", "parallel.zero=1", "train.reduce_each_micro_batch=true"],
     "train.reduce_each_micro_batch=true frees .* parallel.zero=1 keeps the full gradients between micro-batches "
     "anyway: set parallel.zero to 2 or 3, or train.reduce_each_micro_batch=false"),
    (["parallel.dp_shard=2", "parallel.zero=3", "parallel.pp=2", "train.micro_batches=2",
      "train.reduce_each_micro_batch=true"], "under pipelining .* set parallel.pp=1, or"),
    (["parallel.zero=1", "parallel.dp_replicate=2"], "parallel.zero=1 shards over the dp_shard x cp ranks .*"
     "set parallel.dp_shard above 1, or parallel.zero=0"),
    (["train.precision=fp16"], "train.precision='fp16': choose fp32 or bf16"),
    (["parallel.timeout_s=1e12"], "parallel.timeout_s=1000000000000.0 must be a number of seconds from 1 to"),
    (["parallel.timeout_s=nan"], "parallel.timeout_s=nan must be"),
    (["train.beta2=-1"], "train.beta2=-1.0 is out of range: AdamW takes betas in"),
    (["train.eps=0"], "train.eps=0.0 is out of range"),
    (["train.min_lr=1.0"], "train.min_lr=1, where the schedule ends, is above train.lr=0.001, where it starts: "
                           "set train.min_lr to at most 0.001"),
    (["train.lr=5e-5"], "train.min_lr=0.0001, where the schedule ends, is above train.lr=5e-05"),
    (["model.init_std=0"], "model.init_std=0.0 must be a positive number"),
    (["train.lr=.inf"], "train.lr=inf must be a finite number above 0"),
    (["checkpoint.every=-1"], "checkpoint.every=-1 must be 0 \\(no periodic ones\\) or more"),
    (["checkpoint.keep=-1"], "checkpoint.keep=-1 must be 0 \\(keep all\\) or more"),
    (["data.val_fraction=1"], "data.val_fraction=1.0, the share held out for validation, must be 0 or more and "
                              "below 1"),
    (["data.val_fraction=0", "train.eval_every=5"], "train.eval_every=5 evaluates on the val split, which "
     "data.val_fraction=0 leaves empty: set data.val_fraction above 0, or train.eval_every=0"),
    (["model.vocab_size=99999999999999999999"], "model.vocab_size=99999999999999999999 must be below 2\\*\\*31"),
    (["train.global_batch=99999999999999999999"], "train.global_batch=99999999999999999999 must be below 2\\*\\*31"),
    (["data.cache_dir="], "data.cache_dir is empty: set it to the directory that keeps the tokenized corpus"),
    (["a=1"], "unknown config key 'a'; valid keys: checkpoint, data, log, model, parallel, train"),
    (["data.max_bytes=-1"], "data.max_bytes=-1 must be 0 \\(all of the corpus\\) or more"),
    (["data.source= "], "data.source is empty: name a file, a directory or a pattern"),
    (["train.steps=2", "configs/tiny.yaml"], "override 'configs/tiny.yaml' must look like section.key=value \\(the "
     "config file comes first, and only one\\)"),
    (["data.tokenizer=bpe", "data.bpe_vocab_size=4096"], "data.bpe_vocab_size=4096 is more than "
     "model.vocab_size=320, which must hold every token"),
    (["data.tokenizer=bpe", "data.bpe_vocab_size=100"], "data.bpe_vocab_size=100 must be at least 258 \\(256 bytes "
     "and <\\|endoftext\\|>\\)"),
])
def test_impossible_layouts(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_min_lr_is_not_checked_for_a_constant_schedule():
    """A constant schedule never reaches min_lr: an lr below min_lr's default is allowed with it."""
    assert load_config(None, ["train.lr=5e-5", "train.schedule=constant"]).train.lr == 5e-5


def test_world_size_mismatch():
    cfg = load_config(None, ["parallel.dp_replicate=2"])
    validate(cfg, world_size=2)
    with pytest.raises(ConfigError, match=r"world size 4 does not equal .* = 2.*--nproc 2"):
        validate(cfg, world_size=4)


def test_shipped_configs_load():
    from pathlib import Path
    for path in sorted(Path(__file__).parent.parent.glob("configs/*.yaml")):
        load_config(path)


@pytest.mark.parametrize("overrides,message", [
    (["model.moe_experts=6", "parallel.dp_shard=4", "parallel.ep=4"], "must divide model.moe_experts=6"),
    (["model.moe_experts=8", "parallel.dp_shard=2", "parallel.ep=4"], "must divide parallel.dp_shard"),
    (["model.moe_experts=4", "model.moe_top_k=5"], "moe_top_k=5"),
    (["parallel.dp_shard=2", "parallel.ep=2"], "this model has none \\(model.moe_experts=0\\)"),
    (["model.moe_experts=4", "model.moe_aux_weight=nan"], "model.moe_aux_weight=nan must be 0 \\(off\\) or a positive"),
    (["model.moe_experts=4", "model.moe_z_weight=-1"], "model.moe_z_weight=-1.0 must be 0"),
    (["model.moe_top_k=5", "model.moe_shared_expert=true"], "model.moe_top_k=5, model.moe_shared_expert=true: for "
                                                             "MoE layers, and model.moe_experts=0 makes every layer "
                                                             "dense; set model.moe_experts, or leave those out"),
    (["model.moe_every=2"], "model.moe_every=2: for MoE layers, .* or leave it out"),
])
def test_bad_expert_layouts_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_bad_log_every_is_refused_with_its_value():
    with pytest.raises(ConfigError, match=r"^log.every=0 must be at least 1 \(a log line every this many steps\)$"):
        load_config(None, ["log.every=0"])


def test_parameter_counts_of_shipped_shapes():
    from pathlib import Path
    root = Path(__file__).parent.parent / "configs"
    assert load_config(root / "llama3-8b.yaml").model.num_params() == 8_030_261_248
    assert load_config(root / "bench.yaml").model.num_params() == 6_163_712
    assert load_config(root / "mixtral-8x7b.yaml").model.num_params() == 46_702_792_704
