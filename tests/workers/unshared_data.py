"""Two ranks as on two machines whose copies of the corpus differ (argv: config, a directory): each reads
data.source=corpus.txt in a directory of its own, rank 1's with one more line. Both must be refused before the
first step, naming the data."""
import os
import sys
from pathlib import Path

from sixfold.config import load_config
from sixfold.data import DataError
from sixfold.train import train

config, root = sys.argv[1:]
rank = int(os.environ["RANK"])
home = Path(root) / f"machine{rank}"
home.mkdir(parents=True, exist_ok=True)
os.chdir(home)
Path("corpus.txt").write_text("a line of text that the two copies share\n" * 400 + "one more line\n" * rank)
try:
    train(load_config(config, [f"log.run_dir={Path(root) / 'run'}", "data.source=corpus.txt", "data.cache_dir=cache",
                               "parallel.dp_replicate=2", "log.progress=false"]))
except DataError as e:
    print(f"rank {rank} refused: {e}", flush=True)
