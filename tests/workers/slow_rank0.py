"""Rank 0 draws the pictures, writes its part of a checkpoint, publishes a background save or reads its part of a
checkpoint for longer than parallel.timeout_s (argv: config, run directory, "pictures", "save", "async" or
"resume"): the other rank waits for it, checking in, and both end the run without an error.

    torchrun --nproc-per-node 2 slow_rank0.py CONFIG RUN_DIR pictures|save|async|resume
"""
import os
import sys
import time

from sixfold import train as train_module
from sixfold import train_state
from sixfold.config import load_config


def slowly(fn):
    def slow(*args):
        if os.environ["RANK"] == "0":
            time.sleep(8)
        return fn(*args)
    return slow


config, run_dir, slow = sys.argv[1:]
common = [f"log.run_dir={run_dir}", "parallel.dp_shard=2", "parallel.timeout_s=3", "log.trace=true",
          "checkpoint.every=1"]
if slow == "resume":
    train_module.train(load_config(config, [*common, "train.steps=1"]))
    train_state.load = slowly(train_state.load)
    train_module.train(load_config(config, [*common, "train.steps=2", "checkpoint.resume=auto"]))
else:
    if slow == "pictures":
        train_module.draw_pictures = slowly(train_module.draw_pictures)
    elif slow == "save":
        train_state.Saver._files = slowly(train_state.Saver._files)
    else:
        train_state.Saver._publish = slowly(train_state.Saver._publish)
        common.append("checkpoint.async_save=true")
    train_module.train(load_config(config, [*common, "train.steps=2"]))
print(f"rank {os.environ['RANK']} done", flush=True)
