"""Under each ZeRO stage, after a step: the bytes held in parameters, gradients and optimizer state equal
the ZeRO formula for this model and layout (with padding), and the collectives equal theirs. During the step,
ZeRO-2/3 hold the full gradients of the units that need them only: the head's unit in forward, the last
REDUCING units reduced at the end of the backward. Under ZeRO-1/2 the next step's forward waits for each unit's
weight gather just before the unit runs; ZeRO-3 starts the gathers of the next step's first two units in the
optimizer.

    torchrun --nproc-per-node 4 zero_buffers.py ZERO:PRECISION[:once] ...   (each case in turn, on one layout)
"""
import sys

from sixfold.config import load_config
from sixfold.mesh import ParallelContext
from sixfold.parallel.sharding import REDUCING
from sixfold.train import Trainer

MICRO, SHARDS = 2, 4


def config(zero: int, precision: str, once: bool):
    return load_config("configs/tiny.yaml", [f"parallel.dp_shard={SHARDS}", f"parallel.zero={zero}",
                                             *(["parallel.reshard_after_forward=false"] if once else []),
                                             f"train.precision={precision}", f"train.micro_batches={MICRO}",
                                             "log.run_dir=/tmp/unused"])


def check(ctx: ParallelContext, zero: int, precision: str, once: bool) -> dict:
    """One case's checks; the bytes it held."""
    cfg = config(zero, precision, once)
    trainer = Trainer(cfg, ctx)
    size = lambda t: t.untyped_storage().size()
    units = trainer.sharded.units
    seen = {"forward": [], "end": []}  # units holding full gradients: in each forward's head, at each backward's end
    record = lambda key: seen[key].append({u.index for u in units if size(u.grad)})
    trainer.model.norm.register_forward_hook(lambda *_: record("forward"))
    trainer.model.embed.weight.register_post_accumulate_grad_hook(lambda p: record("end"))  # runs after sharding's
    trainer.train_step()
    k = len(units)
    every = set(range(k))
    if zero >= 2:  # the first micro-batch allocates as its backward goes; the last one's reductions free
        assert seen == {"forward": [{k - 1}, every], "end": [every, set(range(REDUCING))]}, seen
    else:
        assert seen == {"forward": [every] * MICRO, "end": [every] * MICRO}, seen

    # the formula, from the config alone
    m = cfg.model
    n = SHARDS if zero else 1
    pad = lambda x: -(-x // (16 * n)) * 16 * n
    block = m.dim * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * m.dim * m.ffn_dim + 2 * m.dim
    unit_sizes = [m.vocab_size * m.dim] + [block] * m.n_layers + [m.dim + m.vocab_size * m.dim]
    padded = sum(pad(x) for x in unit_sizes)
    shard = padded // n
    rank = ctx.rank_in("fsdp") if zero else 0
    owned = sum(max(0, min((rank + 1) * pad(x) // n, x) - rank * pad(x) // n) for x in unit_sizes)
    b = 2 if precision == "bf16" else 4
    own_master = n > 1 or precision == "bf16"
    # ZeRO-3 gathers the next step's first two units (the embedding and the first block) during the optimizer
    ahead = b * (pad(unit_sizes[0]) + pad(unit_sizes[1])) if zero == 3 else 0
    expected = {
        # bf16 sharded: a bf16 copy of the shard to gather from (unsharded, the compute weights serve)
        "parameters": (b * padded if zero < 3 else ahead) + (4 * shard if own_master else 0)
        + (b * shard if b == 2 and n > 1 else 0),
        "gradients": (b * padded if zero < 2 else 0) + (4 * shard if own_master else 0),
        "optimizer": 8 * owned,
    }

    # what the buffers hold
    extra = lambda t, *counted: 0 if any(t is c for c in counted) else size(t)  # a buffer not counted yet
    holding = lambda: {
        "parameters": sum(size(u.full) + extra(u.master, u.full) + extra(u.compute_shard, u.master, u.full)
                          for u in units),
        "gradients": sum(size(u.grad) + extra(u.grad_shard, u.grad) for u in units),
        "optimizer": sum(t.numel() * t.element_size() for m in trainer.optim.moments for t in m.values()),
    }
    held = holding()
    assert held == expected, (zero, precision, held, expected)
    assert cfg.model.num_params() == sum(unit_sizes)

    ledger, calls = trainer.comm.ledger.total, trainer.comm.ledger.calls
    if zero == 0:
        assert calls["loss", "all_reduce"] == k + 2 and ledger["loss", "all_reduce"] == 4 * padded + 16
    else:
        assert calls["fsdp", "reduce_scatter"] == k and ledger["fsdp", "reduce_scatter"] == 4 * padded
    if zero in (1, 2):
        assert calls["fsdp", "all_gather"] == k and ledger["fsdp", "all_gather"] == b * padded
    if zero == 3 and once:  # every unit gathered once per step, and the next step's first two; bf16 moves half
        assert calls["fsdp", "all_gather"] == k + 2 and ledger["fsdp", "all_gather"] == b * padded + ahead
    elif zero == 3:
        # each forward gathers every unit but the head's and the last block's (kept from the first forward on);
        # each backward gathers the other blocks (the embedding's backward reads no weights); the optimizer the next
        # step's first two units; bf16 moves half the bytes
        embed, blocks = pad(unit_sizes[0]), sum(pad(x) for x in unit_sizes[1:-2])
        calls_expected = k + MICRO * (m.n_layers - 1) + (MICRO - 1) * (k - 2) + 2
        bytes_expected = b * (padded + MICRO * blocks + (MICRO - 1) * (embed + blocks)) + ahead
        assert calls["fsdp", "all_gather"] == calls_expected and ledger["fsdp", "all_gather"] == bytes_expected

    if zero in (1, 2):  # the weights gathered after a step: each unit's waited for by its next forward, in order
        assert all(u.gather is not None for u in units), [u.index for u in units if u.gather is None]
        pending = []  # at each unit's forward (after sharding's own hook): the units whose gathers are still pending
        for u in units:
            u.modules[0].register_forward_pre_hook(
                lambda m, a, u=u: pending.append((u.index, {v.index for v in units if v.gather is not None})))
        trainer.train_step()
        assert pending[:k] == [(i, set(range(i + 1, k))) for i in range(k)], pending

    if zero == 3:  # the gathers of the next step's first two units are in flight after the step, no other
        assert [u.gather is not None for u in units] == [True, True] + [False] * (k - 2), [u.gather for u in units]
        trainer.sharded.settle()
        trainer.sharded.publish_all()  # as after a load: those units' gathered weights are stale, freed
        assert all(size(u.full) == 0 for u in units), [size(u.full) for u in units]
    trainer.sharded.settle()
    trainer.evaluate()  # holds no more after it than a step does (ZeRO-3: not the next step's first units)
    assert holding() == {**held, "parameters": held["parameters"] - ahead}, (holding(), held)
    return held


cases = [(int(zero), precision, rest == ["once"]) for zero, precision, *rest in (a.split(":") for a in sys.argv[1:])]
ctx = ParallelContext.initialize(config(*cases[0]).parallel)  # one layout for all: dp_shard=SHARDS
for zero, precision, once in cases:
    held = check(ctx, zero, precision, once)
    if ctx.rank == 0:
        print(f"zero {zero} {precision} {'once ' if once else ''}buffers OK: {held}", flush=True)
ctx.close()
