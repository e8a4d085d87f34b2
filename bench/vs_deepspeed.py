"""Issue #11's common workload in DeepSpeed 0.19.8 and in sixfold, alternating on this machine, in the rows the issue
gives DeepSpeed a time (1 process, dp 2, dp 4): its ZeRO-3 column in `sixfold bench --table` is fixed numbers from a
machine the issue does not name; this puts it beside sixfold.

    python3 -m venv /tmp/ds && /tmp/ds/bin/pip install torch==2.13.0 deepspeed==0.19.8 transformers==5.24.0  # once
    python bench/vs_deepspeed.py --python /tmp/ds/bin/python --runs 3 --write

DeepSpeed trains Hugging Face's LlamaForCausalLM of the workload's shape (it brings no model; what bench/
deepspeed_cpu.py builds and sets is listed there) on sixfold's tokens of configs/bench.yaml's corpus, 4 sequences
of 256 tokens per rank, fp32, gloo, as ZeRO-3 (the issue's) and ZeRO-1; sixfold as `sixfold bench --table` runs the
row (dp_replicate) and as ZeRO-3 (dp_shard). A run's time is rank 0's mean wall time per step after the 2 warm-up
steps (3-10 by default), from step to step, on both sides. Without --python (or DEEPSPEED_PYTHON) it says so and
exits with SKIPPED.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from peers import Peer, arguments, peer_env, publish, rounds, sharded, sixfold_ways, version  # noqa: E402
from sixfold.bench import TABLE, per_step, workload_config  # noqa: E402
from sixfold.measure import others_while, revision  # noqa: E402

RUNNER = Path(__file__).resolve().parent / "deepspeed_cpu.py"
RANKS = {"1 process": 1, "dp 2": 2, "dp 4": 4}  # the rows issue #11 gives DeepSpeed a time in, and their ranks
STAGES = (("ZeRO-3", 3), ("ZeRO-1", 1))
NOTE = ("A way not named is `sixfold bench --table`'s (dp_replicate); sixfold's other is ZeRO-3 (dp_shard). "
        "DeepSpeed trains Hugging Face's LlamaForCausalLM of the same shape on sixfold's tokens, as ZeRO-3 (the "
        "issue's) and ZeRO-1, with torch's AdamW at a constant learning rate (sixfold warms up and decays it). Both "
        "sides' memory is counted from after their process groups are made and their tokens loaded.")


def other_ways(layout) -> list[tuple[str, tuple[str, ...]]]:
    """sixfold's other way of a data-parallel row beside the table's: ZeRO-3, as DeepSpeed's in the issue."""
    return [("ZeRO-3", sharded(layout, 3))] if layout.name.startswith("dp") else []


def tokens(out: Path) -> Path:
    """sixfold's training tokens of the workload's corpus, as a .npy file DeepSpeed's runner reads."""
    from sixfold.data import load_data

    path = out / "tokens.npy"
    np.save(path, np.asarray(load_data(workload_config(None, [], 10).data).train))
    return path


def ds_run(python: str, work: Path, tokens_path: Path, ranks: int, stage: int, steps: int) -> dict:
    """One DeepSpeed job: rank 0's mean time per step after warm-up, each rank's peak MB, and the cores other
    processes kept busy meanwhile."""
    with tempfile.TemporaryDirectory(dir=work) as out:
        cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               f"--log-dir={work / 'torchrun'}", str(RUNNER),
               str(tokens_path), str(steps), str(stage), out]
        env = peer_env(ranks, DS_ACCELERATOR="cpu")
        proc, others = others_while(lambda: subprocess.run(cmd, cwd=work, env=env, text=True, capture_output=True))
        found = [Path(out) / f"rank{r}.json" for r in range(ranks)]
        results = [json.loads(f.read_text()) for f in found if f.exists()]
    if proc.returncode or len(results) < ranks:
        sys.exit(f"DeepSpeed ZeRO-{stage} on {ranks} ranks failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return {"step_s": per_step(results[0]["ends"]), "peak_mb": [r["peak_mb"] for r in results], "others": others}


def main() -> None:
    args = arguments(__doc__, "DeepSpeed 0.19.8, transformers 5.24.0 and torch 2.13", "DEEPSPEED_PYTHON", list(RANKS))
    script = "bench/vs_deepspeed.py"
    both = (f"{version(args.python, 'deepspeed', 'DEEPSPEED_PYTHON', script)}, transformers "
            f"{version(args.python, 'transformers', 'DEEPSPEED_PYTHON', script)}")
    peer = Peer("DeepSpeed", both, "vs_deepspeed.py", 2, {}, NOTE)
    layouts = [x for x in TABLE if x.name in RANKS and (not args.only or x.name in args.only)]
    ways = {x.name: sixfold_ways(x, other_ways(x), args.steps)
            + [("DeepSpeed", way, (RANKS[x.name], stage)) for way, stage in STAGES] for x in layouts}
    rev = revision()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        path = tokens(work)
        rows = rounds(ways, args.runs, lambda how: ds_run(args.python, work, path, *how, args.steps))
    publish(rows, args, rev, peer)


if __name__ == "__main__":
    main()
