"""Issue #11's common workload in torchtitan 0.3.0 and in sixfold, alternating on this machine: the peers' times in
`sixfold bench --table` are fixed numbers from a machine the issue does not name; this puts one peer beside sixfold.

    python3 -m venv /tmp/titan && /tmp/titan/bin/pip install torch==2.13.0 torchtitan==0.3.0 triton   # once
    python bench/vs_torchtitan.py --python /tmp/titan/bin/python --runs 3 --write

torchtitan trains its debugmodel (the workload's model: dim 256, 6 layers, 16 heads, vocab 2048) on sixfold's
corpus of configs/bench.yaml (as JSON lines its Hugging Face loader reads), tokenized by a BPE of 2,048 tokens
trained here on the same text, 4 sequences of 256 tokens per data-parallel rank, fp32, through
bench/torchtitan_cpu.py (what it sets and bends to run on a CPU is listed there). A run's time is rank 0's mean
wall time per step over steps 3-10, the loop's own work between steps (logging, sixfold's stop check) in: for
torchtitan from the times its log stamps on each step's line, for sixfold from the elapsed time its trainer
records at each step's end (`sixfold bench`'s jobs; its own table times the steps alone). Beside it, each rank's
peak memory, measured alike on both sides (bench/peers.py). Without --python (or TORCHTITAN_PYTHON) it says so and
exits with SKIPPED.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from peers import Peer, arguments, peer_env, publish, rounds, sharded, sixfold_ways, version  # noqa: E402
from sixfold.bench import TABLE, WARMUP, workload_config  # noqa: E402
from sixfold.measure import others_while, revision  # noqa: E402

SHIM = Path(__file__).resolve().parent / "torchtitan_cpu.py"
BASE = ("--module", "llama3", "--config", "llama3_bench", "--training.seq_len", "256", "--training.local_batch_size",
        "4", "--parallelism.spmd_backend", "partial_dtensor", "--training.disable_cuda_graphs")
REPLICATE, FSDP = "--parallelism.data_parallel_replicate_degree", "--parallelism.data_parallel_shard_degree"
PP = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1")
ZERO_BUBBLE = ("--parallelism.pipeline_parallel_schedule", "InterleavedZeroBubble")
# torchtitan's ways of running each row of sixfold's TABLE (as issue #11 measured it): (name, ranks, arguments).
# Its replication is fully_shard over a replicate x 1 mesh (HSDP, shards of 1), which issue #11 calls DDP; its
# pipeline runs its debugmodel's schedule (interleaved 1F1B, 2 stages a rank) and its fastest here of the others
TITAN = {
    "1 process": [("", 1, ())],
    "dp 2": [("replicated", 2, (REPLICATE, "2", FSDP, "1")), ("FSDP", 2, (FSDP, "2"))],
    "dp 4": [("replicated", 4, (REPLICATE, "4", FSDP, "1")), ("FSDP", 4, (FSDP, "4"))],
    "tp 2": [("", 2, ("--parallelism.tensor_parallel_degree", "2"))],
    "pp 2 (4 micro-batches)": [("interleaved", 2, PP), ("interleaved zero bubble", 2, (*PP, *ZERO_BUBBLE))],
    "dp2 x tp2": [("FSDP", 4, (FSDP, "2", "--parallelism.tensor_parallel_degree", "2"))],
    "dp2 x pp2": [("FSDP, interleaved", 4, (FSDP, "2", *PP)),
                  ("FSDP, interleaved zero bubble", 4, (FSDP, "2", *PP, *ZERO_BUBBLE))],
}


def other_ways(layout) -> list[tuple[str, tuple[str, ...]]]:
    """sixfold's other ways of a row of TABLE beside the table's own: ZeRO-1 for data parallelism (the optimizer
    sharded, as torchtitan's FSDP shards it), the zero-bubble schedule ZB-H1 for pipelining (the table's is 1F1B)."""
    ways = []
    if layout.name.startswith("dp"):
        ways.append(("ZeRO-1", sharded(layout, 1)))
    if "parallel.pp_schedule=1f1b" in layout.overrides:
        ways.append(("ZB-H1", tuple(o.replace("=1f1b", "=zb-h1") for o in layout.overrides)))
    return ways


NOT_RUN = {"cp 2": "torchtitan's context parallelism runs SDPA through DTensor, which has no rule for the CPU's flash "
                   "kernel, and flex attention, its other way, has no CPU backward"}
STEP = re.compile(r"^\[titan\] (\S+ \S+) .*?step:\s+(\d+)\s", re.M)


def assets(out: Path) -> None:
    """The workload's corpus as JSON lines, and a tokenizer.json of 2,048 tokens trained on it, in `out`."""
    from sixfold.corpus import iter_documents
    from sixfold.data import BPETokenizer

    docs = [text for _, text, *_ in iter_documents(workload_config(None, [], 10).data)]
    (out / "data").mkdir()
    (out / "data" / "data.json").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    tok = BPETokenizer.train(docs, 2047)._tok  # and a start token: 2,048
    tok.add_special_tokens(["<|begin_of_text|>"])
    (out / "tokenizer").mkdir()
    tok.save(str(out / "tokenizer" / "tokenizer.json"))
    (out / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>", "add_bos_token": True,
         "add_eos_token": True}))


def titan_run(python: str, work: Path, ranks: int, args: tuple[str, ...], steps: int) -> dict:
    """One torchtitan job: rank 0's mean step time after warm-up, from its log, each rank's peak MB (as
    torchtitan_cpu.py measures it), and the cores other processes kept busy meanwhile."""
    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           f"--log-dir={work / 'torchrun'}", "--local-ranks-filter", "0", str(SHIM), *BASE,
           "--hf_assets_path", str(work / "tokenizer"), "--dataloader.dataset_path", str(work / "data"),
           "--training.steps", str(steps), "--dump_folder", str(work / "out"), *args]
    with tempfile.TemporaryDirectory(dir=work) as peaks:
        env = peer_env(ranks, SIXFOLD_PEAK_DIR=peaks)
        proc, others = others_while(lambda: subprocess.run(cmd, cwd=work, env=env, text=True, capture_output=True))
        found = [Path(peaks) / f"rank{r}.json" for r in range(ranks)]
        peak_mb = [json.loads(f.read_text())["peak_mb"] for f in found if f.exists()]
    log = proc.stdout + proc.stderr
    step_s = step_time(log, steps)
    if proc.returncode or step_s is None or len(peak_mb) < ranks:
        sys.exit(f"torchtitan {' '.join(args)} on {ranks} ranks failed:\n{log[-4000:]}")
    return {"step_s": step_s, "peak_mb": peak_mb, "others": others}


def step_time(log: str, steps: int) -> float | None:
    """The mean time per step after warm-up, from the stamps of the log's step lines (None: not all there)."""
    stamps = {int(n): datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f") for t, n in STEP.findall(log)}
    if not {WARMUP, steps} <= stamps.keys():
        return None
    return (stamps[steps] - stamps[WARMUP]).total_seconds() / (steps - WARMUP)


NOTE = ("A way not named is `sixfold bench --table`'s (dp_replicate, 1F1B) or torchtitan's default (in the pipelined "
        "rows its debugmodel's interleaved 1F1B, 2 stages a rank). sixfold's other ways are ZeRO-1 (dp_shard) and the "
        "zero-bubble ZB-H1; torchtitan's its replication, FSDP and InterleavedZeroBubble. Both sides' memory is "
        "counted from after their process groups are made, sixfold's with its corpus loaded, torchtitan's before "
        "its data loader is built (which then counts).")


def main() -> None:
    args = arguments(__doc__, "torchtitan 0.3.0, triton and torch 2.13", "TORCHTITAN_PYTHON",
                     [x.name for x in TABLE if x.name not in NOT_RUN])
    peer = Peer("torchtitan", version(args.python, "torchtitan", "TORCHTITAN_PYTHON", "bench/vs_torchtitan.py"),
                "vs_torchtitan.py", 1, NOT_RUN, NOTE)
    layouts = [x for x in TABLE if x.name not in NOT_RUN and (not args.only or x.name in args.only)]
    ways = {x.name: sixfold_ways(x, other_ways(x), args.steps)
            + [("torchtitan", way, (ranks, a)) for way, ranks, a in TITAN[x.name]] for x in layouts}
    rev = revision()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        assets(work)
        rows = rounds(ways, args.runs, lambda how: titan_run(args.python, work, *how, args.steps))
    publish(rows, args, rev, peer)


if __name__ == "__main__":
    main()
