"""ZeRO-3: every unit whose backward reads its weights has them gathered, or their gather in flight, as its
backward begins: started by a unit the backward reached before it, or kept from the forward (the last layer,
whose backward follows the head's). In an MoE layer a block's backward comes before its experts'."""
import sys

from sixfold.config import load_config
from sixfold.mesh import ParallelContext
from sixfold.train import Trainer

model = sys.argv[1]  # dense, moe, or mixed (every other layer MoE)
experts = {"dense": [], "moe": ["model.moe_experts=4"], "mixed": ["model.moe_experts=4", "model.moe_every=2"]}
cfg = load_config("configs/tiny.yaml", ["parallel.dp_shard=2", "parallel.zero=3", "model.n_layers=4",
                                        "log.run_dir=/tmp/unused", *experts[model]])
ctx = ParallelContext.initialize(cfg.parallel)
trainer = Trainer(cfg, ctx)
sharded = trainer.sharded
reached, before_backward = [], sharded.before_backward


loose = lambda layer: [u for u in layer if u.zero == 3 and not u.keep_gathered]  # gathered for use, then freed
bound = sum(sorted(sum(u.full.numel() * 4 for u in loose(layer)) for layer in sharded.layers)[-2:])
held = []  # bytes of those gathered (or being gathered) as each backward begins and after it


def watched(unit):
    if unit.gathers_for_backward:
        reached.append((unit.index, unit.gather is not None or unit.full.untyped_storage().size() > 0))
    before_backward(unit)
    held.append(sum(u.full.untyped_storage().size() for u in loose(sharded.units)))


sharded.before_backward = watched
for _ in range(2):
    reached.clear()
    trainer.train_step()
    units = sharded.units
    blocks = [u.index for u in units if u.modules[0] in trainer.model.layers.values()]
    experts = {u.index - 1: u.index for u in units if u.expert}
    order = [i for b in reversed(blocks) for i in (b, *([experts[b]] if b in experts else []))]
    assert reached == [(i, True) for i in order], reached
    assert max(held) <= bound, (held, bound)  # at most two layers: the one in use and the next
if ctx.rank == 0:
    print(f"{model} prefetch OK: {reached}")
ctx.close()
