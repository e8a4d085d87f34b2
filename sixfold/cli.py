"""sixfold train | check | matrix | plan | bench | trace | generate | import-hf | export-hf"""
from __future__ import annotations

import signal

# Run as a program (as torchrun's ranks are: python -m sixfold.cli), SIGINT ends the process at once and unsaid, as
# its default does, until main() takes it: not with a traceback of the imports under way (torchrun says the line)
STARTING = __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler
if STARTING:
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import argparse
import contextlib
import difflib
import os
import shlex
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

from .config import (FRESH_START, PICTURES, Config, ConfigError, check_available, check_tensorboard, check_text,
                     check_world_size, load_config, make_run_dir, override, seed_problem, temperature_problem,
                     top_p_problem, validate, writable_dir)
from .console import gone, mute
from .launch import end, run_torchrun, under_torchrun
from .run_lock import check_free
from .stop import interrupting, put_back

SAID_WITHIN_S = 30  # how long a rank waits for its machine's first to say an error all of them raised


def _at_least(low: int):
    """An argparse type: an integer of at least `low`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if said := _below(value, low):
            raise argparse.ArgumentTypeError(f"{value} {said}")
        return value
    return parse


def _below(value: int, low: int) -> str:
    """What is wrong with an integer that must be at least `low`, to follow it ("" for one that is)."""
    return f"must be at least {low}" if value < low else ""


def _seed(text: str) -> int:
    """An argparse type: a random seed, as torch.Generator takes it."""
    value = _at_least(0)(text)
    if said := seed_problem(value):
        raise argparse.ArgumentTypeError(f"{value} {said}")
    return value


def _device(text: str) -> str:
    """An argparse type: a device of this machine the model can run on."""
    import torch
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: give cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text}: give cpu, cuda or cuda:N")
    if device.type == "cuda" and (device.index or 0) >= (n := torch.cuda.device_count()):
        others = f" or cuda:0 to cuda:{n - 1}" if n else ""
        raise argparse.ArgumentTypeError(f"{text}: this machine has {n} CUDA device(s); give cpu{others}")
    return text


def _number(problem):
    """An argparse type: a float that problem(value) finds nothing wrong with (config.py's *_problem)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if said := problem(value):
            raise argparse.ArgumentTypeError(f"{text} {said}")
        return value
    return parse


def _split(items: list[str]) -> tuple[str | None, list[str]]:
    """An optional YAML path first (one with a `=` in it, lr=3e-4.yaml, if it is a file or has a directory before
    the `=`), then key=value overrides."""
    first = items[0] if items else ""
    if first and ("=" not in first or Path(first).is_file() or "/" in first.split("=", 1)[0]):
        return items[0], items[1:]
    return None, items


def _keys(override: str) -> list[str]:
    """The section.key names an override sets (as override() reads them): a section's mapping sets each of its."""
    key, raw = (part.strip() for part in override.split("=", 1))
    if "." not in key:
        import yaml
        with contextlib.suppress(yaml.YAMLError):
            if isinstance(value := yaml.safe_load(raw), dict):
                return [f"{key}.{k}" for k in value]
    return [key]


def _without_nproc(argv: list[str]) -> list[str]:
    """argv without `--nproc N` or `--nproc=N` (the ranks started must not start ranks again)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def _relaunch(args, argv: list[str], cfg) -> int | None:
    """Outside torchrun, a multi-process layout starts its own ranks on this machine, once the corpus is read
    and tokenized (and cached for the ranks) here: its errors come before any rank starts, and no rank waits
    through the tokenizing for the first one."""
    if under_torchrun():
        return None
    nproc = args.nproc or cfg.parallel.world_size
    if nproc == 1:
        return None
    from .join import job_world
    if (world := job_world()) > 1:  # another launcher's: a job of our own here would train apart from its others
        raise ConfigError(f"WORLD_SIZE={world} makes this process one rank of a job of {world}, and LOCAL_RANK, "
                          f"which torchrun sets, is not set: sixfold train would start {nproc} ranks of its own here, "
                          f"apart from the job's others. Start each machine's ranks with torchrun, set LOCAL_RANK "
                          f"(and RANK, MASTER_ADDR, MASTER_PORT) in each rank started otherwise, or unset WORLD_SIZE "
                          f"to train on this machine alone")
    from .data import load_data
    from .train import check_inputs, data_settings
    said = []
    try:
        with warnings.catch_warnings(record=True) as said:  # said by rank 0 again (from the cache's index)
            warnings.simplefilter("always")
            check_inputs(cfg, load_data(data_settings(cfg)))
    except Exception:  # then only here
        for w in said:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        raise
    return run_torchrun(nproc, argv).returncode


def _config(args):
    """The validated config of `train` and `check`, refused early if it cannot run here."""
    path, overrides = _split(args.config)
    cfg = load_config(path, overrides)
    check_available(cfg)
    if args.nproc:
        validate(cfg, world_size=args.nproc)
    return cfg


def cmd_train(args, argv) -> int:
    try:
        cfg = _config(args)
        check_tensorboard(cfg)
        made = _missing(Path(cfg.log.run_dir))
        run_dir = make_run_dir(cfg)
    except ConfigError as e:  # from the command line and the machine's files: alike on each of its ranks
        from .errors import on_every_rank
        raise on_every_rank(e) from None
    if under_torchrun():  # (rank 0 takes the lock; the ranks leave the directory to the launcher)
        made = None
    else:
        check_free(run_dir)
    code = 1
    try:
        launched = _relaunch(args, _without_nproc(argv), cfg)
        if launched is None:
            from .train import train
            train(cfg)
        code = launched or 0
        return code
    finally:
        if code and made:  # a run refused, or ended before writing anything: no empty directory left behind
            _remove_unused(run_dir, made)


def _missing(path: Path) -> Path | None:
    """The outermost of `path` and its parents that does not exist yet (None if `path` does)."""
    missing = None
    for p in [path, *path.parents]:
        if p.exists():
            break
        missing = p
    return missing


def _remove_unused(run_dir: Path, top: Path) -> None:
    """Remove run_dir, then its parents up to `top`, each as long as it holds nothing but a lock file."""
    from .run_lock import LOCK
    for p in [run_dir, *run_dir.parents]:
        with contextlib.suppress(OSError):
            if [e.name for e in p.iterdir()] == [LOCK]:
                (p / LOCK).unlink()
            p.rmdir()
        if p.exists() or p == top:
            return


def cmd_check(args, argv) -> int:
    from .parity import LEARN_STEPS
    cfg = _config(args)
    if cfg.train.precision == "fp32" and cfg.train.grad_reduce != "fp32":
        raise ConfigError("sixfold check compares fp32 runs to round-off; set train.grad_reduce=fp32 (or check "
                          "bf16 training, train.precision=bf16, which is held to learn like fp32)")
    args.steps = args.steps or (5 if cfg.train.precision == "fp32" else LEARN_STEPS)
    if given := [f"checkpoint.{k}={v}" for k in FRESH_START if (v := getattr(cfg.checkpoint, k))]:
        raise ConfigError(f"sixfold check starts the layout and the single process from the same initial weights: "
                          f"{' and '.join(given)} would not be used; leave {'them' if given[1:] else 'it'} out")
    overrides = _split(args.config)[1]
    if override(overrides, "train.steps"):
        raise ConfigError(f"sixfold check runs --steps steps (now {args.steps}), not train.steps: give --steps "
                          f"instead")
    from .data import load_data
    from .parity import QUIET, check, layout_config, reference_config, reference_key
    unused = [k for k in ("log.run_dir", *(f"{s}.{k}" for s, keys in QUIET.items() for k in keys))
              if override(overrides, k)]
    if unused:
        warnings.warn(f"sixfold check runs both sides its own way, without {', '.join(unused)} as given (--workdir "
                      f"keeps the two runs' directories)")
    from .train import check_inputs
    layout = layout_config(cfg, Path("."), args.steps)
    if reference_key(layout) == reference_key(reference_config(cfg, Path("."), args.steps)):
        raise ConfigError("the config trains as the single-process reference does: sixfold check would compare the "
                          "run with itself; give the layout to check (e.g. parallel.dp_shard=2)")
    if args.workdir:
        earlier = [name for name in ("layout", "reference") if (Path(args.workdir) / name).exists()]
        if earlier:
            raise ConfigError(f"--workdir {args.workdir} holds an earlier check's runs ({', '.join(earlier)}); remove "
                              f"them or give another --workdir")
        writable_dir(args.workdir, "--workdir")
    check_inputs(layout, load_data(cfg.data))  # here, not by each rank
    result = check(cfg, args.steps, args.workdir)
    print(result.line())
    return 0 if result.ok else 1


def cmd_trace(args, argv) -> int:
    from .pictures import SOURCES, draw_pictures
    run = Path(args.run)
    if not (run / "config.yaml").is_file():
        raise ConfigError(f"{run} is not a run directory (it has no config.yaml)")
    try:
        written = draw_pictures(run)
    except OSError as e:
        if e.filename and Path(e.filename).name in SOURCES:
            raise ConfigError(f"cannot read {e.filename}: {e.strerror or e}; make it readable") from None
        # a read-only run directory, a full disk, a directory where a picture goes
        raise ConfigError(f"cannot draw {run}'s pictures: {e}; they go to {', '.join(PICTURES)} in it: make it "
                          f"writable, or copy the run elsewhere and draw them there") from None
    if not written:
        raise ConfigError(f"{run} has no trace.json or comm_ledger.json to draw, and no pipeline (train it, with "
                          f"log.trace=true for the timeline)")
    for path in written:
        print(f"wrote {path}")
    for name, source, how in ((PICTURES[0], "trace.json", "train with log.trace=true"),
                              (PICTURES[2], "comm_ledger.json", "a run writes it as it ends")):
        if run / name in written:
            continue
        if (run / name).is_file():  # left by an earlier run in this directory
            print(f"kept {run / name}, not redrawn: the run has no {source} (or no events in it) to draw it from")
        else:
            print(f"no {name}: the run has no {source} (or no events in it) to draw it from ({how})")
    if (run / "trace.json").is_file():
        from .trace import overlap_table, read_chrome_trace
        print(overlap_table(read_chrome_trace(run / "trace.json")))
    return 0


def cmd_plan(args, argv) -> int:
    from .planner.devices import DEVICES, NODE_GPUS
    from .planner.plan import CHOSEN, plan, search
    from .planner.report import describe, ranking, refusals
    from tqdm import tqdm
    path, overrides = _split(args.config)
    cfg = load_config(path, overrides, check=not args.search)  # the search validates each layout it plans
    if args.nodes is None:  # machines of NODE_GPUS, as these GPUs come
        if args.gpus > NODE_GPUS and args.gpus % NODE_GPUS:
            raise ConfigError(f"--gpus {args.gpus} do not fill machines of {NODE_GPUS}: give --nodes, the machines "
                              f"they are spread over")
        args.nodes = -(-args.gpus // NODE_GPUS)
    if args.gpus % args.nodes:
        raise ConfigError(f"--gpus {args.gpus} must be divisible by --nodes {args.nodes}")
    device, per_node = DEVICES[args.gpu], args.gpus // args.nodes
    if args.search:
        if chosen := [k for k in CHOSEN if override(overrides, k)]:
            warnings.warn(f"--search chooses {', '.join(chosen)} for each layout it plans, not as given; plan that "
                          f"layout without --search, or leave {'them' if chosen[1:] else 'it'} out")
        refused: dict[str, str] = {}
        try:
            plans = search(cfg, args.gpus, device, per_node, refused, lambda plans, total: tqdm(
                plans, total=total, desc="plan", unit="layout", leave=False, disable=None))  # on a terminal only
        except ConfigError as e:  # with what the trainer refused, which may be why
            raise ConfigError("\n".join([str(e), *refusals(refused)])) from None
        print(ranking(plans, cfg, (args.gpu, args.gpus, args.nodes), refused,
                      len(plans) if args.top == 0 else args.top or 10))
        return 0
    if args.top is not None:
        raise ConfigError(f"--top {args.top} chooses how many layouts --search shows: add --search, or leave it out")
    check_world_size(cfg.parallel, args.gpus, "--gpus", "--gpus, or add --search")
    validate(cfg)
    print(describe(plan(cfg, device, per_node), args.gpu, args.gpus, args.nodes))
    return 0


def cmd_bench(args, argv) -> int:
    from .bench import bench
    bench(args, *_split(args.config), argv)
    return 0


def cmd_matrix(args, argv) -> int:
    from . import matrix
    path, overrides = _split(args.config)
    load_config(path, overrides)  # refused here, before any process starts
    if args.workdir:
        writable_dir(args.workdir, "--workdir")
    if args.table and args.only:
        raise ConfigError(f"--table {args.table} with --only: the table lists the whole matrix (docs/parity.md: every "
                          f"layout); leave out --only to write it, or --table to run some layouts")
    if args.table:
        writable_dir(Path(args.table).parent, "--table's directory")
        if Path(args.table).is_dir():
            raise ConfigError(f"--table {args.table} is a directory: give the path of the file to write")
    report = matrix.run(path, overrides, args.workdir, args.only)
    for row in report.rows:
        print(row.line())
    if args.table:
        Path(args.table).write_text(report.table(shlex.join(["sixfold", *argv])))
    failed = [row.layout.name for row in report.rows if not row.ok]
    rows = len(report.rows)
    print(f"parity matrix: {rows - len(failed)} of {rows} layout{'s' * (rows != 1)} OK in {report.seconds:.0f}s"
          + (f"; FAILED: {', '.join(failed)}" if failed else "")
          + (f"; the runs are in {report.kept}" if report.kept else ""))
    return 1 if failed else 0


def cmd_generate(args, argv) -> int:
    from .checkpoint import Checkpoint
    from .generate import checkpoint_tokenizer, prompt_ids, prompt_problem, sample_text
    from .model.hf import carried_files, end_ids, load_model, sampling, saved_config
    check_text(args.prompt, "--prompt")
    checkpoint = Checkpoint(args.checkpoint)  # opened once: a run saving meanwhile moves its `latest` on
    cfg = saved_config(checkpoint)  # the tokenizer and prompt refused before the weights are read
    tok = checkpoint_tokenizer(checkpoint, cfg)
    given, limit = len(prompt_ids(tok, args.prompt)), cfg.model.max_seq_len
    if said := prompt_problem(given, limit):
        raise ConfigError(f"--prompt is {said}")
    carried = carried_files(checkpoint)
    stop = end_ids(carried)  # an instruct model's end of turn, say
    chosen = {k: v for k, v in vars(args).items() if k in SAMPLING and v is not None}
    settings = {**SAMPLING, **_recommended(sampling(carried), checkpoint.path), **chosen}
    import torch
    model = load_model(checkpoint, args.device or ("cuda" if torch.cuda.is_available() else "cpu"))[0]
    room = limit - given
    if args.max_new_tokens > room:
        warnings.warn(f"--max-new-tokens {args.max_new_tokens}: the model's max_seq_len={limit} "
                      f"leaves room for {room} after the prompt; at most {room} are generated")
    print(sample_text(model, tok, args.prompt, args.max_new_tokens, settings["temperature"], settings["top_k"],
                      args.seed, stop, top_p=settings["top_p"]))
    return 0


SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 1.0}  # sixfold generate's, where the checkpoint gives none


def _recommended(settings: dict, where) -> dict:
    """A carried generation_config.json's sampling settings, each refused by name if out of range."""
    problems = {"temperature": temperature_problem, "top_p": top_p_problem,
                "top_k": lambda k: _below(k, 0) if isinstance(k, int) else "is not an integer"}  # as --top-k
    for key, value in settings.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if said := problems[key](value) if number else "is not a number":
            raise ConfigError(f"{where}'s generation_config.json has {key}={value!r}, which {said}; give "
                              f"--{key.replace('_', '-')}")
    return settings


def cmd_import_hf(args, argv) -> int:
    from .model.hf import import_hf
    print(f"wrote {import_hf(args.hf_dir, args.out)}")
    return 0


def cmd_export_hf(args, argv) -> int:
    from .model.hf import export_hf
    print(f"wrote {export_hf(args.checkpoint, args.out, args.dtype)}")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("sixfold")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "(not installed)"


class Command(argparse.ArgumentParser):
    """A parser that keeps the option strings it was given (argparse lists them only in private fields)."""

    def __init__(self, *args, **kwargs):
        self.options: list[str] = []  # before argparse's own add_argument of --help
        super().__init__(*args, **kwargs)

    def add_argument(self, *names, **kwargs):
        self.options += [n for n in names if n.startswith("-")]
        return super().add_argument(*names, **kwargs)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sixfold", description="Train LLaMA-style models over a 6-D device mesh.")
    p.add_argument("--version", action="version", version=f"sixfold {_version()}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Command)
    p.commands = sub.choices  # name -> the command's own parser
    t = sub.add_parser("train", help="train a model: sixfold train CONFIG [key=value ...] [--nproc N]")
    t.add_argument("config", nargs="*", help="a YAML file, then section.key=value overrides")
    t.add_argument("--nproc", type=_at_least(1), help="start N ranks on this machine with torchrun (default and "
                                                        "only choice: the layout's world size)")
    t.set_defaults(fn=cmd_train)
    c = sub.add_parser("check", help="compare a layout with the single-process run: parity OK / FAILED")
    c.add_argument("config", nargs="*", help="an optional YAML file, then section.key=value overrides")
    c.add_argument("--nproc", type=_at_least(1), help="ranks of the layout's run (default and only choice: the "
                                                        "layout's world size)")
    c.add_argument("--steps", type=_at_least(1), help="steps of both runs (default 5; with train.precision=bf16, 50)")
    c.add_argument("--workdir", default=None, help="keep both runs here (default: a temporary directory)")
    c.set_defaults(fn=cmd_check)
    r = sub.add_parser("trace", help="redraw a run directory's pictures from its trace.json, comm_ledger.json and "
                                      "config.yaml")
    r.add_argument("run", metavar="RUN", help="a run directory (log.run_dir)")
    r.set_defaults(fn=cmd_trace)
    pl = sub.add_parser("plan", help="memory per rank and estimated step time of a layout on a cluster, or "
                                     "--search: every layout ranked")
    pl.add_argument("config", nargs="*", help="a YAML file, then section.key=value overrides")
    pl.add_argument("--gpus", type=_at_least(1), required=True, help="GPUs in all (the layout's world size)")
    pl.add_argument("--gpu", type=str.lower, choices=["h100", "h200", "a100"], default="h100",
                    help="their kind (default h100)")
    pl.add_argument("--nodes", type=_at_least(1), default=None, help="machines the GPUs are spread over, in equal "
                    "numbers (default: machines of 8)")
    pl.add_argument("--search", action="store_true", help="rank every layout of --gpus GPUs that fits")
    pl.add_argument("--top", type=_at_least(0), default=None, help="with --search: the fastest N shown (default "
                    "10; 0: all that fit)")
    pl.set_defaults(fn=cmd_plan)
    b = sub.add_parser("bench", help="step time and peak memory of a layout on the common workload (--table: 8 "
                                      "layouts beside picotron's, torchtitan's and DeepSpeed's times on it), or "
                                      "--max-seq: the longest train.seq_len that fits")
    b.add_argument("config", nargs="*", help="a YAML file (default configs/bench.yaml), then section.key=value "
                                             "overrides; a timed layout's train.global_batch is 4 sequences per "
                                             "data-parallel rank unless an override gives it (--max-seq keeps the "
                                             "config's)")
    b.add_argument("--steps", type=int, default=None, help="steps per run (default 10); the first 2 are not timed")
    b.add_argument("--table", action="store_true", help="time the table's 8 layouts, beside the other frameworks")
    b.add_argument("--write", action="store_true", help="with --table: write it into docs/benchmarks.md")
    b.add_argument("--runs", type=int, default=1, help="with --table: rounds over the layouts, the median reported")
    b.add_argument("--max-seq", action="store_true", help="search the longest train.seq_len that fits, by probes "
                                                          "of 2 steps")
    b.add_argument("--budget-gb", type=float, default=None, help="--max-seq: GB a rank may use (required on CPU: "
                                                                 "resident-set growth; on CUDA: allocated)")
    b.add_argument("--min", type=_at_least(1), default=None, help="--max-seq: the first length probed (default "
                                                                   "train.seq_len)")
    b.add_argument("--max", type=_at_least(1), default=None, help="--max-seq: the longest length probed (default "
                                                                   "1048576)")
    b.set_defaults(fn=cmd_bench)
    m = sub.add_parser("matrix", help="every layout of the parity matrix against the single process, in one job")
    m.add_argument("config", nargs="*", help="the base config (configs/tiny.yaml), then section.key=value overrides")
    m.add_argument("--only", nargs="+", default=None, help="these layouts (and those they resume from)")
    m.add_argument("--workdir", default=None, help="keep every run here (default: a temporary directory)")
    m.add_argument("--table", default=None, help="write the table here (docs/parity.md)")
    m.set_defaults(fn=cmd_matrix)
    g = sub.add_parser("generate", help="sample text from a checkpoint or run directory")
    g.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT", help="a run directory (its latest checkpoint) or a "
                                                                   "checkpoint")
    g.add_argument("--prompt", required=True, help="the text to continue")
    g.add_argument("--max-new-tokens", type=_at_least(0), default=200, help="tokens to generate (default 200)")
    g.add_argument("--temperature", type=_number(temperature_problem), default=None,
                   help="sampling temperature (default 0.8, or what the checkpoint's generation_config.json samples "
                        "with); 0: greedy, the most likely token each time")
    g.add_argument("--top-k", type=_at_least(0), default=None, help="sample among the k most likely tokens (default "
                                                                    "40, or the checkpoint's); 0: among all")
    g.add_argument("--top-p", type=_number(top_p_problem), default=None,
                   help="then among the fewest most likely whose probabilities reach p (default 1: all, or the "
                        "checkpoint's)")
    g.add_argument("--seed", type=_seed, default=0, help="the sampling's random seed (default 0)")
    g.add_argument("--device", type=_device, default=None,
                   help="where the model runs: cpu, cuda or cuda:N (default: the first GPU if there is one, else cpu)")
    g.set_defaults(fn=cmd_generate)
    i = sub.add_parser("import-hf", help="convert a transformers LlamaForCausalLM or MixtralForCausalLM directory "
                                         "to a checkpoint")
    i.add_argument("hf_dir", metavar="HF_DIR", help="a directory written by save_pretrained")
    i.add_argument("out", metavar="OUT_CHECKPOINT", help="the checkpoint directory to write (new)")
    i.set_defaults(fn=cmd_import_hf)
    e = sub.add_parser("export-hf", help="write a run or checkpoint as a transformers LlamaForCausalLM (or, with "
                                         "experts, MixtralForCausalLM) directory")
    e.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT", help="a run directory (its latest checkpoint) or a "
                                                                   "checkpoint")
    e.add_argument("out", metavar="HF_DIR", help="the directory to write (new)")
    e.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the weights' type in the files (default fp32, as sixfold keeps them; bf16 halves the size)")
    e.set_defaults(fn=cmd_export_hf)
    return p


TEXTS = ("--prompt",)  # options whose value is free text


def joined(argv: list[str]) -> list[str]:
    """`--prompt TEXT` as `--prompt=TEXT`: argparse would take a TEXT that starts with '-' for an option."""
    out = []
    for a in argv:
        if out and out[-1] in TEXTS:
            out[-1] += "=" + a
        else:
            out.append(a)
    return out


def _unrecognized(command: Command, extra: list[str]) -> NoReturn:
    """The command's usage and what it does not take: each unknown option with the nearest it has, or the config
    key of its name."""
    flags = [a.split("=")[0] for a in extra if a.startswith("-")]
    if not flags:
        command.error(f"unrecognized arguments: {' '.join(extra)} (overrides are section.key=value)")
    options = command.options
    keys = [f"{section}.{key}" for section, values in Config().to_dict().items() for key in values]
    said = []
    for flag in flags:
        key = [k for k in keys if k.split(".")[1] == flag.lstrip("-").replace("-", "_")]
        near = [f"the config key {key[0]}=VALUE"] if key else difflib.get_close_matches(flag, options, 1, 0.75)
        said.append(flag + (f" (did you mean {near[0]}?)" if near else ""))
    command.error(f"unrecognized option {', '.join(said)}; {command.prog} takes "
                  f"{', '.join(o for o in options if o.startswith('--'))}")


def main(argv: list[str] | None = None) -> int:
    argv = joined(list(sys.argv[1:] if argv is None else argv))
    cli = parser()
    args, extra = cli.parse_known_args(argv)
    if extra and hasattr(args, "config") and all("=" in a and not a.startswith("-") for a in extra):
        args.config += extra  # overrides after the flags
    elif extra:
        _unrecognized(cli.commands[args.command], extra)
    given = [k for a in _split(getattr(args, "config", []))[1] if "=" in a for k in _keys(a)]
    twice = sorted({k for k in given if given.count(k) > 1})
    if twice:
        cli.commands[args.command].error(f"{', '.join(twice)} given more than once; give each key once")
    if args.command == "train" and not args.config:
        cli.commands["train"].error("name a config file (configs/tiny.yaml, configs/demo.yaml) or give key=value "
                                    "overrides of the defaults")
    warnings.formatwarning = lambda message, category, *rest: f"warning: {message}\n"
    rank = f" (rank {os.environ['RANK']})" if os.environ.get("RANK") else ""
    # (a rank's signals are torchrun's: it sends SIGTERM to stop the others when one fails, whose error is the line)
    previous = {} if under_torchrun() else interrupting()
    try:
        if STARTING:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        code = _run(args, argv, rank)
        try:
            sys.stdout.flush()
        except OSError:  # the command's work is done: what is left for a reader that has ended goes nowhere
            mute(sys.stdout)
        return code
    except BrokenPipeError:  # output whose reader has ended (`| head`): the command ends, as a pipe's writer does
        lost = [s for s in (sys.stdout, sys.stderr) if gone(s)]
        if not lost:  # another pipe's
            raise
        for stream in lost:
            mute(stream)
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt as e:  # outside the training steps (starting up, or after the last step); Interrupted too
        name = getattr(e, "signal_name", "SIGINT")
        said = " outside the training steps: as the run started (nothing saved) or as it ended (all written)" \
            if args.command == "train" else ""
        if os.environ.get("LOCAL_RANK", "0") == "0":  # torchrun passes it to every rank: said once a machine
            _tell(f"sixfold: interrupted by {name}{said}")
        return 128 + signal.Signals[name]
    finally:
        put_back(previous)


def _run(args, argv: list[str], rank: str) -> int:
    """The command, its known errors as one line each (torch is imported here, inside main's Ctrl-C handling)."""
    from .benchjob import BenchError
    from .checkpoint import CheckpointError
    from .errors import CommError, PeerStopped
    from .parity import ParityError
    from .stop import Stopped
    from .train import TrainingError
    try:
        return args.fn(args, argv)
    except Stopped as e:
        _say(e, "sixfold", rank)
        return e.exit_code
    except (ValueError, CheckpointError, TrainingError, CommError, PeerStopped, ParityError, BenchError) as e:
        _say(e, "sixfold error", rank)  # ConfigError and DataError are ValueErrors
        return 2


def _say(error: Exception, prefix: str, rank: str) -> None:
    """One line for `error`: from each rank that raised it, or, when every rank raised it alike, from each
    machine's first rank with no rank named (the machine's other ranks end once it has said it, or say it
    themselves if it has not within SAID_WITHIN_S)."""
    from .join import first_done
    if not getattr(error, "on_every_rank", False):
        _tell(f"{prefix}{rank}: {error}")
        return
    first = os.environ.get("LOCAL_RANK", "0") == "0"
    if first:
        _tell(f"{prefix}: {error}")
    if not first_done(first, timedelta(seconds=SAID_WITHIN_S)) and not first:  # its first did not say it
        _tell(f"{prefix}{rank}: {error}")


def _tell(text: str) -> None:
    """On stderr, if it is there (a terminal that hung up with SIGHUP is not)."""
    with contextlib.suppress(OSError):
        print(text, file=sys.stderr, flush=True)


def script() -> NoReturn:
    """The `sixfold` command: main() on sys.argv, then the exit."""
    end(main())


if __name__ == "__main__":
    script()
