"""DeepSpeed's ZeRO on a CPU with gloo, for bench/vs_deepspeed.py: run by torchrun in the Python that has DeepSpeed
(not sixfold's). DeepSpeed brings no model of its own: it trains Hugging Face's LlamaForCausalLM of issue #11's
workload shape (dim 256, 6 layers, 16 heads, ffn 768, vocab 2048, untied: 6,163,712 parameters, as sixfold's),
SDPA attention (the CPU's flash kernel, causal), fp32, torch's AdamW with sixfold's settings (lr 3e-4, betas 0.9
and 0.95, eps 1e-8, weight decay 0.1, none on norms), gradients clipped at 1.0, on windows of the token file
given (sixfold's corpus, tokenized by sixfold), 4 sequences of 256 tokens per rank and step.

    python -m torch.distributed.run --nproc-per-node N deepspeed_cpu.py TOKENS.npy STEPS STAGE OUT

Each rank writes OUT/rank{RANK}.json: its loss and the time at the end of each step (time.perf_counter), and its
peak memory as sixfold's bench jobs measure theirs (resident-set growth from just before the model is built).
"""
import json
import sys
import time
from pathlib import Path

import deepspeed
import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sixfold.measure import mark_memory, peak_mb  # noqa: E402  (standard library only: no sixfold install needed)

ROWS, SEQ = 4, 256
SHAPE = dict(vocab_size=2048, hidden_size=256, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=16,
             intermediate_size=768, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=False)


def main(tokens_path: str, steps: int, stage: int, out: str) -> None:
    tokens = torch.from_numpy(np.load(tokens_path).astype(np.int64))
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    base = mark_memory()
    torch.manual_seed(1234)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, attn_implementation="sdpa", dtype=torch.float32))
    decay = [p for n, p in model.named_parameters() if not n.endswith("norm.weight")]
    flat = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": flat, "weight_decay": 0.0}],
                                  lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    config = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    losses, ends = [], []
    for step in range(steps):
        first = (step * world + rank) * ROWS * SEQ
        batch = tokens[first:first + ROWS * SEQ].view(ROWS, SEQ)
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        ends.append(time.perf_counter())
    Path(out, f"rank{rank}.json").write_text(json.dumps({"loss": losses, "ends": ends, "peak_mb": peak_mb(base)}))
    torch.distributed.barrier()  # ZeRO-3's gloo work ended on every rank before the group goes (else an abort at exit)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
