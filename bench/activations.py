"""Activation memory per rank: the bytes autograd saves for backward in one forward, by tp and sequence-TP.

    python bench/activations.py --tp 1 2 4

One micro-batch of the benchmark workload (configs/bench.yaml: 4 sequences of 256 tokens), fp32. Each
layout is a torchrun job; rank 0 counts with sixfold.activations.SavedTensors (parameters excluded, a
storage counted once). "Split by sequence-TP" are the [tokens, dim] activations and the norms' [tokens, 1]
statistics: replicated over tp without sequence-TP, split over it with.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, machine, revision, write_doc

SEQUENCES = 4


def worker(args) -> None:
    import torch

    from sixfold.activations import SavedTensors
    from sixfold.comm import Comm
    from sixfold.config import ParallelConfig, load_config
    from sixfold.mesh import ParallelContext
    from sixfold.model.llama import Llama, init_weights
    from sixfold.parallel.tensor import TensorParallel
    from sixfold.trace import Tracer

    cfg = load_config(args.config)
    m, seq = cfg.model, cfg.train.seq_len
    ctx = ParallelContext.initialize(ParallelConfig(tp=int(os.environ.get("WORLD_SIZE", 1)),
                                                    sequence_parallel=args.sequence))
    model = Llama(m, TensorParallel(Comm(ctx, Tracer(False, ctx.rank)), args.sequence))
    init_weights(model, 0)
    tokens = torch.randint(0, m.vocab_size, (SEQUENCES, seq), generator=torch.Generator().manual_seed(0))
    with SavedTensors(model) as saved:
        model.loss_sum(tokens, tokens)
    here = SEQUENCES * seq // (ctx.size("tp") if args.sequence else 1)
    split = saved.token_rows_nbytes(here, m.dim)
    if ctx.rank == 0:
        Path(args.out).write_text(json.dumps({"total": saved.nbytes, "split": split}))
    ctx.close()


def run(tp: int, sequence: bool, config: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}", __file__,
               "--worker", "--config", config, "--out", str(out), *(["--sequence"] if sequence else [])]
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True, capture_output=True)
        if proc.returncode:
            sys.exit(f"tp={tp} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--config", default=str(ROOT / "configs" / "bench.yaml"))
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--sequence", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    mib = 2 ** 20
    lines = [f"Command: `python bench/activations.py {' '.join(sys.argv[1:])}`  ", f"Machine: {machine()}  ",
             f"sixfold: {revision()}", "",
             "| layout | saved per rank MiB | of which split by sequence-TP MiB | the rest MiB | total vs tp=1 |",
             "|---|---|---|---|---|"]
    base = None
    for tp in args.tp:
        for sequence in ([False, True] if tp > 1 else [False]):
            r = run(tp, sequence, args.config)
            base = base or r["total"]
            name = f"tp={tp}" + (", sequence-TP" if sequence else "")
            lines.append(f"| {name} | {r['total'] / mib:.2f} | {r['split'] / mib:.2f} | "
                         f"{(r['total'] - r['split']) / mib:.2f} | {r['total'] / base:.3f} |")
            print(lines[-1], flush=True)
    body = "\n".join(lines)
    write_doc("tp-activations", "Activation memory under tensor parallelism", body)
    print(body)


if __name__ == "__main__":
    main()
