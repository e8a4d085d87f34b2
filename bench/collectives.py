"""Reduce-scatter on gloo: sixfold's (an all-to-all of the slices, then their sum on each rank) beside
torch.distributed.reduce_scatter_tensor, over the same group, on the same fp32 tensors.

    python bench/collectives.py --ranks 2 4 [--write]

Each rank count is one torchrun job (OMP_NUM_THREADS=1 per rank). For each input size the two sides alternate
in blocks of --repeats calls, after one warm-up block each; a side's time is the median of its blocks' means.
The results of the two sides are checked equal (to fp32 round-off: they add in different orders).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from common import ROOT, add_write, save_result, torchrun, write_doc
from sixfold.measure import machine, revision

SIZES_KB = (256, 1024, 4096, 16384)  # input per rank


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from sixfold.comm import Comm
    from sixfold.config import load_config
    from sixfold.mesh import ParallelContext
    from sixfold.trace import Tracer

    ctx = ParallelContext.initialize(load_config(args.config, [f"parallel.dp_replicate={args.world}"]).parallel)
    comm, group = Comm(ctx, Tracer(False, ctx.rank)), ctx.groups["dp_replicate"]
    rows = []
    for kb in SIZES_KB:
        x = torch.randn(kb * 256, generator=torch.Generator().manual_seed(ctx.rank))
        ours, theirs = torch.empty(x.numel() // args.world), torch.empty(x.numel() // args.world)
        sides = {"torch": lambda: dist.reduce_scatter_tensor(theirs, x, group=group),
                 "sixfold": lambda: comm.reduce_scatter(ours, x, "dp_replicate")}
        blocks = {name: [] for name in sides}
        for block in range(args.blocks + 1):
            order = list(sides.items())
            for name, call in order if block % 2 else order[::-1]:  # each side first in every other block
                dist.barrier(group)
                start = time.perf_counter()
                for _ in range(args.repeats):
                    call()
                if block:  # the first block warms up
                    blocks[name].append((time.perf_counter() - start) / args.repeats)
        rows.append({"kb": kb, **{name: statistics.median(b) for name, b in blocks.items()},
                     "error": float((ours - theirs).norm() / theirs.norm())})
    save_result(args.out, {"rows": rows})
    ctx.close()


def report(results: dict[int, list[dict]], args) -> str:
    lines = [f"Command: `python bench/collectives.py {' '.join(sys.argv[1:])}`  ",
             f"Machine: {machine()}  ", f"sixfold: {revision()}  ",
             f"Date: {time.strftime('%Y-%m-%d')}; {args.blocks} alternating blocks of {args.repeats} calls per side "
             "and size; OMP_NUM_THREADS=1 per rank. Times are ms per call (median of the blocks' means).", "",
             "| ranks, input per rank | torch reduce_scatter_tensor ms | sixfold ms | time ratio | "
             "relative difference |",
             "|---|---|---|---|---|"]
    for world, rows in results.items():
        for r in rows:
            lines.append(f"| {world} ranks, {r['kb']} KB | {r['torch'] * 1e3:.2f} | {r['sixfold'] * 1e3:.2f} | "
                         f"**{r['sixfold'] / r['torch']:.3f}** | {r['error']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--config", default=str(ROOT / "configs" / "tiny.yaml"))
    add_write(p)
    p.add_argument("--worker", action="store_true", help="(internal)")
    p.add_argument("--world", type=int, help="(internal)")
    p.add_argument("--out", help="(internal)")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    results = {}
    for world in args.ranks:
        ranks, _ = torchrun(__file__, world, "--worker", "--world", str(world), "--blocks", str(args.blocks),
                            "--repeats", str(args.repeats), "--config", args.config)
        results[world] = ranks[0]["rows"]
    body = report(results, args)
    print(body)
    write_doc("collectives", "Reduce-scatter on gloo: sixfold vs torch.distributed", body, args.write)


if __name__ == "__main__":
    main()
