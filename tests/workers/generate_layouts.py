"""The end-of-run sample in a parallel layout: the text one process's model of the same weights samples, and as
many weight gathers (ZeRO-3, over fsdp and edp) for a sample of 2 new tokens as for one of 8.

    torchrun --nproc-per-node 2 generate_layouts.py parallel.dp_shard=2 parallel.zero=3 ...
"""
import sys

from sixfold.config import load_config
from sixfold.generate import generate, prompt_ids, sample_text
from sixfold.mesh import ParallelContext
from sixfold.model.llama import Llama, init_weights
from sixfold.train import Trainer

PROMPT = "def "
cfg = load_config("configs/tiny.yaml", ["log.run_dir=/tmp/unused", "model.init_std=0.3", *sys.argv[1:]])
ctx = ParallelContext.initialize(cfg.parallel)
trainer = Trainer(cfg, ctx)
whole = Llama(cfg.model)
init_weights(whole, cfg.train.seed)
tok, ledger, gathers = trainer.data.tokenizer, trainer.comm.ledger, {}
for n in (2, 8):
    drawn = generate(whole, prompt_ids(tok, PROMPT), n, 0.8, 40, cfg.train.seed, {tok.eot}, tok.vocab_size)
    assert len(drawn) == n and tok.eot not in drawn, drawn  # the sample is n tokens long
    cfg.log.sample_prompt, cfg.log.sample_tokens = PROMPT, n
    ledger.close("other")
    text = trainer.sample()
    traffic = ledger._take()
    assert text == sample_text(whole, tok, PROMPT, n, seed=cfg.train.seed), (n, text)
    gathers[n] = {k: (v["calls"], v["bytes"]) for k, v in traffic.items()
                  if k in ("fsdp/all_gather", "edp/all_gather")}  # the weights' (tp's gathers the logits)
print(f"rank {ctx.rank} gathers (calls, bytes) by new tokens: {gathers}")
assert gathers[2] == gathers[8], gathers
ctx.close()
