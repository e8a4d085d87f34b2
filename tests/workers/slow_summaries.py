"""Rank 0 draws the pictures for longer than parallel.timeout_s (argv: config, run directory): the other rank
waits for it, checking in, and both end the run without an error.

    torchrun --nproc-per-node 2 slow_summaries.py CONFIG RUN_DIR
"""
import os
import sys
import time

from sixfold import train as train_module
from sixfold.config import load_config

draw = train_module.draw_pictures


def slowly(*args):
    time.sleep(8)
    return draw(*args)


config, run_dir = sys.argv[1:]
train_module.draw_pictures = slowly
train_module.train(load_config(config, [f"log.run_dir={run_dir}", "parallel.dp_shard=2", "train.steps=2",
                                        "parallel.timeout_s=3", "log.trace=true"]))
print(f"rank {os.environ['RANK']} done", flush=True)
