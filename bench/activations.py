"""Activation memory per rank: the bytes autograd saves for backward in one forward, by tp and sequence-TP or by
cp and its attention mode; and how evenly cp spreads the causal attention work.

    python bench/activations.py --tp 1 2 4 [--write]
    python bench/activations.py --cp 1 2 4 [--cp-mode ring allgather ulysses] [--write]

One micro-batch of the benchmark workload (configs/bench.yaml: 4 sequences of 256 tokens), fp32. Each
layout is a torchrun job; each rank counts with sixfold.activations.SavedTensors (parameters excluded, a
storage counted once). "Split by sequence-TP" are the [tokens, dim] activations and the norms' [tokens, 1]
statistics: replicated over tp without sequence-TP, split over it with. Under cp each rank also counts, per
sequence and head, the (query, key) pairs causal attention needs for its queries and those the ring computes
(fully masked chunk pairs skipped, diagonal ones computed whole).
"""
from __future__ import annotations

import argparse
import os
import sys

from common import ROOT, add_write, machine, revision, save_result, torchrun, write_doc
from sixfold.parallel.context import MODES

SEQUENCES = 4
NOTES = {"ring": "keeps only its own keys and values",
         "allgather": "keeps every rank's keys and values, per layer (and one [local, seq] mask under 128 local "
                      "tokens)",
         "ulysses": "attention's output (1/cp of the heads) and the projection's input (1/cp of the tokens) "
                    "are two copies"}


def setup(config: str, layout: str, seq_len: int = 0, sequences: int = SEQUENCES, sequence: bool = False,
          mode: str = "ring", zigzag: bool = True):
    """In a torchrun rank: the model with `layout` (tp or cp) over every rank, and this rank's part of
    `sequences` random sequences of seq_len tokens (default: the config's)."""
    import torch

    from sixfold.comm import Comm
    from sixfold.config import ParallelConfig, load_config
    from sixfold.mesh import ParallelContext
    from sixfold.model.llama import Llama, init_weights
    from sixfold.parallel.context import ContextParallel
    from sixfold.parallel.tensor import TensorParallel
    from sixfold.trace import Tracer

    cfg = load_config(config)
    ctx = ParallelContext.initialize(ParallelConfig(**{layout: int(os.environ.get("WORLD_SIZE", 1))},
                                                    sequence_parallel=sequence))
    comm = Comm(ctx, Tracer(False, ctx.rank))
    cp = ContextParallel(comm, mode, zigzag)
    model = Llama(cfg.model, TensorParallel(comm, sequence), cp)
    init_weights(model, 0)
    tokens = torch.randint(0, cfg.model.vocab_size, (sequences, seq_len or cfg.train.seq_len),
                           generator=torch.Generator().manual_seed(0))
    return ctx, model, cp.shard(tokens)


def worker(args) -> None:
    from sixfold.activations import SavedTensors
    from sixfold.parallel.context import _pairs

    ctx, model, tokens = setup(args.config, args.layout, sequence=args.sequence, mode=args.cp_mode[0],
                               zigzag=not args.contiguous)
    with SavedTensors(model) as saved:
        model.loss_sum(tokens, tokens)
    here = tokens.numel() // (ctx.size("tp") if args.sequence else 1)
    cp, local = model.cp, tokens.shape[1]
    save_result(args.out, {"total": saved.nbytes, "split": saved.token_rows_nbytes(here, model.cfg.dim),
                           "causal": int((cp.positions(local, "cpu") + 1).sum()),
                           "ring": (local // len(cp.chunks)) ** 2 * sum(len(_pairs(cp, o)) for o in range(cp.size))})
    ctx.close()


def run(args, world: int, *options: str) -> list[dict]:
    return torchrun(__file__, world, "--worker", "--config", args.config, *options)[0]


def tp_table(args) -> list[str]:
    mib = 2 ** 20
    lines = ["| layout | saved per rank MiB | of which split by sequence-TP MiB | the rest MiB | total vs tp=1 |",
             "|---|---|---|---|---|"]
    base = None
    for tp in args.tp:
        for sequence in ([False, True] if tp > 1 else [False]):
            r = run(args, tp, "--layout", "tp", *(["--sequence"] if sequence else []))[0]
            base = base or r["total"]
            name = f"tp={tp}" + (", sequence-TP" if sequence else "")
            lines.append(f"| {name} | {r['total'] / mib:.2f} | {r['split'] / mib:.2f} | "
                         f"{(r['total'] - r['split']) / mib:.2f} | {r['total'] / base:.3f} |")
            print(lines[-1], flush=True)
    return lines


def cp_tables(args) -> list[str]:
    memory = ["| layout | saved per rank MiB | vs cp=1 | ideal 1/cp | note |", "|---|---|---|---|---|"]
    balance = ["| layout | causal (q, k) pairs per rank | max/min | pairs the ring computes per rank | max/min |",
               "|---|---|---|---|---|"]
    base = None
    for cp in args.cp:
        runs = [(m, True) for m in args.cp_mode] + [(args.cp_mode[0], False)] if cp > 1 else [(args.cp_mode[0], True)]
        for mode, zigzag in runs:
            ranks = run(args, cp, "--layout", "cp", "--cp-mode", mode, *([] if zigzag else ["--contiguous"]))
            saved = max(r["total"] for r in ranks)
            base = base or saved
            name = f"cp={cp}" + (f", {mode}" if cp > 1 else "") + ("" if zigzag else ", contiguous")
            memory.append(f"| {name} | {saved / 2 ** 20:.2f} | {saved / base:.3f} | {1 / cp:.3f} | "
                          f"{NOTES[mode] if cp > 1 else ''} |")
            print(memory[-1], flush=True)
            if cp > 1 and mode == args.cp_mode[0]:
                cells = []
                for k in ("causal", "ring"):
                    counts = [r[k] for r in ranks]
                    cells += [", ".join(map(str, counts)), f"{max(counts) / min(counts):.2f}"]
                balance.append(f"| cp={cp}, {'zigzag' if zigzag else 'contiguous'} | {' | '.join(cells)} |")
    return memory + [""] + balance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", help="tp sizes (the default, without --cp: 1 2 4)")
    parser.add_argument("--cp", type=int, nargs="+", help="cp sizes")
    parser.add_argument("--cp-mode", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--config", default=str(ROOT / "configs" / "bench.yaml"))
    add_write(parser)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--layout", choices=("tp", "cp"), help="(internal) the dimension the worker's ranks span")
    parser.add_argument("--sequence", action="store_true", help="(internal) sequence-TP")
    parser.add_argument("--contiguous", action="store_true", help="(internal) contiguous cp chunks")
    parser.add_argument("--out", help="(internal) where a worker writes its result")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    for dim in ("tp", "cp"):
        if getattr(args, dim) and getattr(args, dim)[0] != 1:
            parser.error(f"--{dim} must start with 1, the baseline")
    head = [f"Command: `python bench/activations.py {' '.join(sys.argv[1:])}`  ", f"Machine: {machine()}  ",
            f"sixfold: {revision()}", ""]
    if args.tp or not args.cp:
        args.tp = args.tp or [1, 2, 4]
        write_doc("tp-activations", "Activation memory under tensor parallelism", "\n".join(head + tp_table(args)),
                  args.write)
    if args.cp:
        write_doc("cp-activations", "Activation memory under context parallelism", "\n".join(head + cp_tables(args)),
                  args.write)


if __name__ == "__main__":
    main()
