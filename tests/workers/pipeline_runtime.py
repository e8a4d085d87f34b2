"""Under torchrun with pp ranks, for each schedule: the runtime's gradients equal one process's, its peak of
micro-batches in flight equals the simulator's, W actions compute the deferred weight gradients, B actions
without one send their input gradient before their weight gradient, and the bytes it sends equal its SEND
actions' payload. Each unit's reduction starts in the action that completes its gradients (a W, or an early
sender's weight gradient, as it reports them), none after it. All of it both with each run's receives posted on
their own (gloo's order) and in the batch of the run's sends (`Pipeline.together`, NCCL's order). Generation's
last-token logits through the stages and a KV cache equal one process's; a KV cache that does not fit on one stage
stops all.

    torchrun --nproc-per-node PP pipeline_runtime.py MICRO_BATCHES
"""
import itertools
import os
import sys

import torch

from sixfold.comm import Comm
from sixfold.config import ParallelConfig, load_config
from sixfold.generate import generate
from sixfold.mesh import ParallelContext
from sixfold.model.llama import KVCache, Llama, init_weights
from sixfold.parallel.context import ContextParallel
from sixfold.parallel.pipeline import schedules
from sixfold.parallel.pipeline.runtime import Pipeline
from sixfold.parallel.pipeline.simulate import simulate
from sixfold.parallel.pipeline.stages import split_stages
from sixfold.parallel.sharding import Sharded
from sixfold.parallel.tensor import TensorParallel
from sixfold.trace import Tracer

CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("breadth-first", 2), ("zb-h1", 1), ("zb-v", 2)]

pp, m = int(os.environ["WORLD_SIZE"]), int(sys.argv[1])
cfg = load_config("configs/tiny.yaml", ["model.n_layers=6", "model.tie_embeddings=true"]).model
ctx = ParallelContext.initialize(ParallelConfig(pp=pp))
rank = ctx.rank_in("pp")
g = torch.Generator().manual_seed(5)
micro = [(torch.randint(0, cfg.vocab_size, (2, 16), generator=g),
          torch.randint(0, cfg.vocab_size, (2, 16), generator=g), None) for _ in range(m)]
scale = sum(y.numel() for _, y, _ in micro)

reference = Llama(cfg)
init_weights(reference, 3)
sum(reference.loss_sum(x, y) for x, y, _ in micro).div(scale).backward()
expected = {n: p.grad for n, p in reference.named_parameters()}

for (name, v), together in itertools.product(CASES, (False, True)):
    if name == "interleaved" and m % pp:  # refused: its micro-batches are a multiple of pp
        continue
    schedule = schedules.build(name, pp, v, m)
    comm = Comm(ctx, Tracer(False, ctx.rank))
    stages = [s for s in split_stages(cfg, pp * v, 16) if schedule.placement[s.index] == rank]
    model = Llama(cfg, TensorParallel(comm), ContextParallel(comm), stages)
    init_weights(model, 3)
    sharded = Sharded(model, comm, 0)
    pipeline = Pipeline(model, schedule, comm, sharded, comm.tracer)
    pipeline.together = together
    late, launches = [False], []  # whether a reduction starts only after its action, at reduce_due

    def reduce_due(reduce_due=sharded.reduce_due):
        late[0] = True
        reduce_due()
        late[0] = False

    sharded.reduce_due = reduce_due
    sharded.launch = lambda unit, launch=sharded.launch: (launches.append(late[0]), launch(unit))
    pipeline.step(micro, scale)
    if pipeline.failed:  # (kept for the trainer to stop every rank with)
        raise pipeline.failed
    sharded.finish()
    for n, p in model.named_parameters():
        err = (p.grad - expected[n]).norm() / expected[n].norm()
        assert err < 1e-5, (name, n, float(err))
    assert pipeline.peak_in_flight == simulate(schedule).ranks[rank].peak_in_flight, (name, pipeline.peak_in_flight)
    ws = sum(a.kind == schedules.W for a in schedule.ranks[rank])
    assert (pipeline.deferred > 0) == (ws > 0), (name, pipeline.deferred)  # W actions do the weight gradients
    assert launches and not any(launches), (name, launches)
    assert pipeline.sent_early == len(schedule.sends_early(rank)), (name, pipeline.sent_early)
    assert pipeline.sent_early == (0 if ws else m * v - (m if rank == 0 else 0)), (name, pipeline.sent_early)
    hidden = 2 * 16 * cfg.dim * 4
    sends = sum(a.kind in (schedules.SEND_F, schedules.SEND_B) for a in schedule.ranks[rank])
    assert comm.ledger.total["pp", "send_recv"] == sends * hidden, (name, dict(comm.ledger.total))
    print(f"rank {rank} {name}{' together' * together}: in flight {pipeline.peak_in_flight}, sent {sends} OK",
          flush=True)

# generation through the last pipeline's stages: each token's logits through the KV cache equal one process's
prompt = torch.randint(0, cfg.vocab_size, (1, 12), generator=g)
cache, alone = KVCache(cfg.n_layers, 12), KVCache(cfg.n_layers, 12)
with torch.no_grad():
    for a, b in ((0, 8), (8, 9), (9, 10), (10, 11), (11, 12)):
        got, want = pipeline(prompt[:, a:b], cache, last=True), reference(prompt[:, a:b], alone, last=True)
        assert got.shape == want.shape and torch.equal(got, want), (b, got - want)

# a KV cache that does not fit on the last stage stops every stage before any forward, with its message
make = KVCache.make
if rank == pp - 1:  # its memory full
    KVCache.make = lambda *args: torch.empty(2 ** 62, dtype=torch.int8)
try:
    generate(pipeline, [1, 2, 3], 4, settle=ctx.first_problem)
except ValueError as e:
    said, everyone = str(e), e.on_every_rank
KVCache.make = make
assert said.startswith("max_new_tokens=4: the KV cache for 7 tokens") and everyone, said
ctx.close()
