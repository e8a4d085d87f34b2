"""Context parallelism against sequence length: time of a forward and backward and bytes saved per rank.

    python bench/cp.py --seq 256 512 1024 2048 --cp 2 [--write]
    python bench/cp.py --seq 256 1024 2048 --cp 2 --documents 100 [--write]

One sequence of the benchmark model (configs/bench.yaml), fp32, on one process (cp=1) and on cp ranks in each
mode (zigzag chunks); each a torchrun job (bench/common.py). A job counts the bytes autograd saves in its first
forward (bench/activations.py), then times forward+backward after the warm-up; a repeat's time is the slowest
rank's, the table shows the median over repeats (range). With --documents N, each layout runs twice, causal over
the whole sequence and within documents of N tokens (data.document_mask; the masks made in each forward), the
two jobs next to each other, either first in every other row (turns).
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

from activations import setup
from common import ROOT, WARMUP, add_write, machine, revision, save_result, spread, torchrun, write_doc
from sixfold.parallel.context import MODES

SEQUENCES = 1


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from sixfold.activations import SavedTensors

    ctx, model, tokens = setup(args.config, "cp", args.seq_len, SEQUENCES, mode=args.mode)
    # documents of args.documents tokens: each one's end of text is its last token
    ids = torch.arange(args.seq_len)[None] // args.documents if args.documents else None
    with SavedTensors(model) as saved:
        loss = model.loss_sum(tokens, tokens, ids)
    loss.backward()  # the first warm-up step
    times = []
    for _ in range(WARMUP - 1 + args.repeats):
        model.zero_grad(set_to_none=True)
        if ctx.world_size > 1:
            dist.barrier()
        start = time.perf_counter()
        model.loss_sum(tokens, tokens, ids).backward()
        times.append(time.perf_counter() - start)
    save_result(args.out, {"saved": saved.nbytes, "step_s": times[WARMUP - 1:]})
    ctx.close()


def turns(k: int, documents: int) -> tuple[int, int]:
    """--documents of a row's two jobs in the order they run: causal first where k (the row's length's and layout's
    positions summed) is even, so that either goes first in every other row and each layout's order swaps from one
    length to the next."""
    return (0, documents) if k % 2 == 0 else (documents, 0)


def refused(args) -> str | None:
    """Why the arguments cannot run, before any job: what sixfold's config refuses of a layout at a length (a length
    the zigzag chunks do not divide would leave the ranks' collectives mismatched), or a count out of range."""
    from sixfold.config import ConfigError, load_config

    for flag, value, least in (("--cp", args.cp, 2), ("--repeats", args.repeats, 1), ("--documents", args.documents, 0),
                               *(("--seq", seq, 1) for seq in args.seq)):
        if value < least:
            return f"{flag} {value}: give at least {least}"
    try:
        longest = max(load_config(args.config).model.max_seq_len, *args.seq)  # only sizes the RoPE tables
    except ConfigError as e:
        return str(e)
    for seq, mode in itertools.product(args.seq, args.modes):
        try:
            load_config(args.config, [f"parallel.cp={args.cp}", f"parallel.cp_mode={mode}", f"train.seq_len={seq}",
                                      f"model.max_seq_len={longest}"])
        except ConfigError as e:
            return f"--seq {seq} at --cp {args.cp} in mode {mode}: {e}"
    return None


def name(world: int, mode: str) -> str:
    return f"cp={world}, {mode}" if world > 1 else "cp=1"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[256, 512, 1024, 2048], help="sequence lengths")
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--repeats", type=int, default=5, help=f"timed steps per job, after {WARMUP} warm-up steps")
    p.add_argument("--config", default=str(ROOT / "configs" / "bench.yaml"))
    p.add_argument("--documents", type=int, default=0, help="also time attention within documents of this many tokens")
    add_write(p)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--mode", choices=MODES, default="ring", help="(internal) the worker's cp mode")
    p.add_argument("--seq-len", type=int, help="(internal) the worker's sequence length")
    p.add_argument("--out", help="(internal) where a worker writes its result")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if said := refused(args):
        p.error(said)
    rev, load, others = revision(), os.getloadavg()[0], []

    def job(world: int, mode: str, seq: int, documents: int) -> tuple[list[float], int]:
        ranks, busy = torchrun(__file__, world, "--worker", "--config", args.config, "--mode", mode, "--seq-len",
                               str(seq), "--repeats", str(args.repeats), "--documents", str(documents))
        others.append(busy)
        return [max(r["step_s"][i] for r in ranks) for i in range(args.repeats)], max(r["saved"] for r in ranks)

    layouts = [(1, "ring")] + [(args.cp, m) for m in args.modes]
    if args.documents:
        rows = ["| sequence | layout | causal s | within documents s | time ratio | causal saved MiB | within "
                "documents saved MiB | memory ratio |", "|---|---|---|---|---|---|---|---|"]
    else:
        rows = ["| sequence | layout | s per forward+backward | vs cp=1 | saved per rank MiB | vs cp=1 |",
                "|---|---|---|---|---|---|"]
    for i, seq in enumerate(args.seq):
        base = None
        for j, (world, mode) in enumerate(layouts):
            if args.documents:
                done = {documents: job(world, mode, seq, documents) for documents in turns(i + j, args.documents)}
                (step, saved), (within, within_saved) = done[0], done[args.documents]
                rows.append(f"| {seq} | {name(world, mode)} | {spread(step, 3)} | {spread(within, 3)} | "
                            f"{statistics.median(within) / statistics.median(step):.2f} | {saved / 2 ** 20:.1f} | "
                            f"{within_saved / 2 ** 20:.1f} | {within_saved / saved:.3f} |")
            else:
                step, saved = job(world, mode, seq, 0)
                base = base or (statistics.median(step), saved)
                rows.append(f"| {seq} | {name(world, mode)} | {spread(step, 3)} | "
                            f"{statistics.median(step) / base[0]:.2f} | {saved / 2 ** 20:.1f} | "
                            f"{saved / base[1]:.3f} |")
            print(rows[-1], flush=True)
    body = "\n".join([
        f"Command: `python bench/cp.py {' '.join(sys.argv[1:])}`  ", f"Machine: {machine()}  ", f"sixfold: {rev}  ",
        f"Date: {time.strftime('%Y-%m-%d')}; {args.repeats} timed steps per job after {WARMUP} warm-up steps"
        + (f"; documents of {args.documents} tokens, a row's two jobs one after the other, within documents first "
           f"in every other row (each layout's order swapping from one length to the next)" if args.documents else "")
        + ". Other "
        f"processes kept {statistics.median(others):.2f} cores busy in the median job, {max(others):.2f} at most; "
        f"load average (1 min) {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"
        + (": a shared machine, read the times as rough." if max(others) > 0.5 else "."), "", *rows])
    if args.documents:
        write_doc("cp-documents", "Context parallelism within documents", body, args.write)
    else:
        write_doc("cp", "Context parallelism against sequence length", body, args.write)
    print(body)


if __name__ == "__main__":
    main()
