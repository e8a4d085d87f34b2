"""Rank 1's disk fills while it writes its checkpoint files (argv: config, run directory, async_save true or
false): every rank stops with rank 1's error at once, not a timeout, and nothing of the failed save is left."""
import errno
import sys

from sixfold import checkpoint
from sixfold.checkpoint import CheckpointError
from sixfold.config import load_config
from sixfold.train import train


def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


config, run_dir, background = sys.argv[1:]
rank = int(__import__("os").environ["RANK"])
if rank == 1:
    checkpoint.save_tensors = full
try:
    train(load_config(config, [f"log.run_dir={run_dir}", "parallel.dp_shard=2", "parallel.zero=2", "train.steps=4",
                               "checkpoint.every=2", "parallel.timeout_s=60", "log.progress=false",
                               f"checkpoint.async_save={background}"]))
except CheckpointError as e:
    print(f"rank {rank} stopped: {e}", flush=True)
