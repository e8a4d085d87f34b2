"""Two ranks as on two machines that do not share the run directory (argv: config, a directory): each works in a
directory of its own with a relative log.run_dir. Both must be refused before the first step, naming it."""
import os
import sys
from pathlib import Path

from sixfold.config import ConfigError, load_config
from sixfold.train import train

config, root = sys.argv[1:]
rank = int(os.environ["RANK"])
home = Path(root) / f"machine{rank}"
home.mkdir(parents=True, exist_ok=True)
os.chdir(home)
try:
    train(load_config(config, ["log.run_dir=run", "parallel.dp_replicate=2", "log.progress=false"]))
except ConfigError as e:
    print(f"rank {rank} refused: {e}", flush=True)
