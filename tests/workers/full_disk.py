"""The disk fills (argv: config, run directory, what): with "sync" or "async" (checkpoint.async_save) while rank 1
writes its checkpoint files (with "final", async too, the final checkpoint's, the run's only one), with "metrics"
while rank 0 appends step 3's line to metrics.jsonl. Every rank stops with the failing rank's error at once, not a
timeout; nothing of a failed save is left."""
import builtins
import errno
import os
import sys

from sixfold import checkpoint, logs
from sixfold.checkpoint import CheckpointError
from sixfold.config import load_config
from sixfold.train import TrainingError, train


def full():
    return OSError(errno.ENOSPC, "No space left on device")


def save_nothing(*args, **kwargs):
    raise full()


class Filling:
    """metrics.jsonl on a disk that fills after two lines: the flush fails, and so does closing with them buffered."""

    def __init__(self, file):
        self.file, self.name, self.lines = file, file.name, 0

    def write(self, text):
        self.lines += 1
        return self.file.write(text) if self.lines <= 2 else len(text)

    def flush(self):
        if self.lines > 2:
            raise full()
        self.file.flush()

    def close(self):
        self.file.close()
        if self.lines > 2:
            raise full()


def opening(path, mode="r", *args, **kwargs):
    file = builtins.open(path, mode, *args, **kwargs)
    return Filling(file) if str(path).endswith("metrics.jsonl") else file


config, run_dir, what = sys.argv[1:]
rank = int(os.environ["RANK"])
if rank == 1 and what != "metrics":
    checkpoint.save_tensors = save_nothing
if rank == 0 and what == "metrics":
    logs.open = opening
try:
    final = what == "final"
    train(load_config(config, [f"log.run_dir={run_dir}", "parallel.dp_shard=2", "parallel.zero=2", "train.steps=4",
                               f"checkpoint.every={0 if final else 2}", "parallel.timeout_s=60",
                               f"log.progress={final}", f"checkpoint.async_save={what in ('async', 'final')}"]))
except (CheckpointError, TrainingError) as e:
    print(f"rank {rank} stopped: {e}", flush=True)
