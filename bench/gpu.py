"""Single-GPU training throughput and MFU: sixfold's trainer beside a transformers LlamaForCausalLM step of the same
shape (configs/llama3-1b.yaml: Llama-3.2-1B, 1,235,814,400 parameters, tied embeddings), bf16.

    python bench/gpu.py --seq 2048 8192 --out DIR          # on the GPU machine: one process per (side, seq)
    python bench/gpu.py --report DIR/gpu.json --write      # here: the table into docs/benchmarks.md

sixfold: bf16 compute weights with fp32 master weights and fused AdamW over flat buffers, SDPA (flash) attention,
torch.compile per block, the head and cross-entropy fused over chunks of --chunk tokens. transformers: fp32
weights under torch.autocast(bf16), SDPA attention, fused AdamW, the full logits (its own loss), gradient
clipping as sixfold's. Both see --tokens tokens per step (seq_len x sequences): sixfold the stdlib corpus in bytes,
transformers one batch of random token ids. sixfold is compiled unless a side says otherwise (sixfold:0), and
transformers not (hf:1 compiles the model), so the default rows set compiled beside eager.

MFU = FLOPs per step / step time / the GPU's dense bf16 peak (989 TFLOP/s for H100 SXM and H200), with 6 FLOPs
per matmul parameter per token (the tied head counted once, the embedding lookup not at all) and causal
attention's 6 * seq * dim per token per layer (half the full square). A second MFU counts attention's full square (12 *
seq * dim), as torchtitan's and PaLM's formulas do, for comparison with numbers reported that way.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def model_config(config: str, seq: int):
    from sixfold.config import load_config
    return load_config(config, [f"model.max_seq_len={max(seq, 2048)}"]).model


def device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only to try the script on a small config


def sync() -> None:
    import torch
    if device() == "cuda":
        torch.cuda.synchronize()


def timed(step, steps: int, warmup: int) -> tuple[list[float], float]:
    """Each step's time, the device synchronized around it, and then the mean time of as many steps more run one
    after another as a training loop runs them (the device synchronized after the last): what the host does
    between two steps can then overlap the device's work."""
    times = []
    for i in range(warmup + steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return times, (time.perf_counter() - start) / steps


def sixfold_side(args, result: dict):
    """The step of sixfold's trainer; each step's MFU as its log line gives it goes into result["logged_mfu"]."""
    from sixfold.config import load_config
    from sixfold.mesh import ParallelContext
    from sixfold.train import Trainer

    cfg = load_config(args.config, [
        f"model.max_seq_len={max(args.seq, 2048)}", f"train.seq_len={args.seq}",
        f"train.global_batch={args.micro * args.tokens // args.seq}", f"train.micro_batches={args.micro}",
        "train.precision=bf16", f"train.compile={args.compile}",
        f"model.loss_chunk={args.chunk}", f"model.recompute={args.recompute}", "data.tokenizer=byte",
        "data.max_bytes=50000000", f"train.steps={args.warmup + args.steps}", "log.progress=false",
        "log.tensorboard=false", "checkpoint.save_final=false", f"log.run_dir={tempfile.mkdtemp()}", *args.set])
    trainer = Trainer(cfg, ParallelContext.single())
    logged = result.setdefault("logged_mfu", [])

    def step():
        metrics = trainer.train_step()
        logged.append(metrics.get("mfu"))
        return metrics["loss"]

    return step


def hf_side(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sixfold.model.hf import hf_config_from_model

    m = model_config(args.config, args.seq)
    config = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.ffn_dim,
                         num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads,
                         rope_theta=m.rope_theta, rope_scaling=hf_config_from_model(m)["rope_scaling"],
                         rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings,
                         max_position_embeddings=max(args.seq, 2048), attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device())
    if args.compile:
        model.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
    tokens = torch.randint(0, m.vocab_size, (args.tokens // args.seq, args.seq), device=device())

    def step():
        total = 0.0
        for _ in range(args.micro):
            with torch.autocast(device(), dtype=torch.bfloat16):
                loss = model(input_ids=tokens, labels=tokens).loss / args.micro
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(total)

    return step


def worker(args) -> None:
    import torch
    torch.backends.cuda.matmul.allow_tf32 = True
    result = {"side": args.worker, "seq": args.seq, "tokens": args.micro * args.tokens, "micro": args.micro,
              "compile": args.compile, "config": args.config, "set": args.set}
    try:
        step = sixfold_side(args, result) if args.worker == "sixfold" else hf_side(args)
        result["tree"] = str(Path(sys.modules["sixfold"].__file__).resolve().parent.parent)
        losses = []
        result["times"], result["back_to_back"] = timed(lambda: losses.append(step()), args.steps, args.warmup)
        result["loss_first"], result["loss_last"] = losses[0], losses[args.warmup + args.steps - 1]
        result["losses"] = losses
        if args.profile:
            profile(step, args.trace)
        result["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30 if device() == "cuda" else 0.0
    except torch.cuda.OutOfMemoryError:
        result["oom"] = True
    Path(args.result).write_text(json.dumps(result))


def profile(step, trace: str | None) -> None:
    """The GPU kernels of two steps, by total time, and the device's idle gaps between them; the Chrome trace of
    the two steps into `trace`, if given."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as record
    with record(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        step()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))
    path = Path(trace) if trace else Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(path))
    print(idle_gaps(json.loads(path.read_text())["traceEvents"]))


DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCHES = ("cuda_runtime", "cuda_driver")


def idle_gaps(events: list[dict], least_us: float = 20.0, top: int = 15) -> str:
    """Where the device waits for the host, from a profiler's Chrome trace: the time between its first and last
    kernel that no kernel or copy runs, in gaps of at least `least_us`, and the longest gaps, each with the
    kernel before it and the host operations (innermost last) that launched the one after it; and the host's
    synchronizations with the device."""
    spans = [e for e in events if e.get("ph") == "X"]
    work = sorted((e for e in spans if e.get("cat") in DEVICE_WORK), key=lambda e: e["ts"])
    if not work:
        return "idle gaps: no kernel in the trace"
    launches = {e["args"]["correlation"]: e for e in spans
                if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})}
    ops = sorted((e for e in spans if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])

    def launched_by(kernel: dict) -> str:
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is None:
            return "?"
        around = [o["name"] for o in ops if o["tid"] == launch["tid"] and o["ts"] <= launch["ts"] <= o["ts"] + o["dur"]]
        return " > ".join(around[-3:]) or launch["name"]

    gaps, end = [], work[0]["ts"] + work[0]["dur"]
    before = work[0]
    for e in work[1:]:
        if e["ts"] - end >= least_us:
            gaps.append((e["ts"] - end, before, e))
        if e["ts"] + e["dur"] >= end:
            end, before = e["ts"] + e["dur"], e
    span = end - work[0]["ts"]
    idle = sum(g for g, _, _ in gaps)
    syncs = [e for e in spans if e.get("cat") in LAUNCHES and "Synchronize" in e["name"]]
    lines = [f"idle gaps: the device idle {idle / 1000:.1f} ms of {span / 1000:.1f} ms in {len(gaps)} gaps of "
             f"{least_us:.0f} us or more; the host synchronized {len(syncs)} times, blocked "
             f"{sum(e['dur'] for e in syncs) / 1000:.1f} ms", "  ms    after kernel -> launched by"]
    for gap, a, b in sorted(gaps, key=lambda g: -g[0])[:top]:
        lines.append(f"  {gap / 1000:5.2f} {a['name'][:50]} -> {launched_by(b)[:140]}")
    return "\n".join(lines)


def drive(args) -> None:
    """Each run in a worker process; its result goes into OUT/gpu.json as it comes (a run of the same side, sequence
    and micro-batches there before is replaced; the command joins those there), so that a later invocation into
    the same OUT adds rows and a timeout loses only the run it stopped."""
    import torch
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = out / "gpu.json"
    kept = json.loads(table.read_text()) if table.exists() else {"command": "", "results": []}
    command = "python bench/gpu.py " + " ".join("DIR" if a == args.out else a for a in sys.argv[1:])
    commands = [c for c in kept["command"].split("; ") if c and c != command] + [command]
    results = kept["results"]
    for seq, micro, side in ((seq, micro, side) for seq in args.seq for micro in args.micro for side in args.sides):
        name, compiled = side.split(":") if ":" in side else (side, "1" if side == "sixfold" else "0")
        path = out / f"{name}-{compiled}-{seq}-{micro}.json"
        cmd = [sys.executable, __file__, "--worker", name, "--seq", str(seq), "--tokens", str(args.tokens),
               "--micro", str(micro),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--chunk", str(args.chunk),
               "--recompute", args.recompute, "--compile", "true" if compiled == "1" else "false",
               "--config", args.config, "--out", str(out), "--result", str(path)]
        began = time.time()
        proc = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True, capture_output=True)
        if proc.returncode or not path.exists():
            print(proc.stdout[-2000:], proc.stderr[-4000:], flush=True)
            continue
        r = json.loads(path.read_text())
        r["wall_s"] = time.time() - began
        same = (r["side"], r["compile"], r["seq"], r["micro"])
        results = [k for k in results if (k["side"], k["compile"], k["seq"], k["micro"]) != same] + [r]
        print(line(r, name_of_device()), flush=True)
        table.write_text(json.dumps({"device": name_of_device(), "torch": torch.__version__,
                                     "command": "; ".join(commands), "results": results}, indent=1))


def name_of_device() -> str:
    import torch
    return torch.cuda.get_device_name() if device() == "cuda" else "cpu"


def mfu(r: dict, device: str) -> tuple[float, float, float]:
    """tokens/s, MFU, and MFU with attention's full square counted."""
    from sixfold.planner.devices import DEVICES
    from sixfold.planner.timing import attention_flops, model_flops_per_token
    from sixfold.utilization import peak_flops
    peak = peak_flops(device, "bf16") or DEVICES["h100"].peak_flops
    tokens_s = r["tokens"] / statistics.median(r["times"])
    cfg = model_config(r["config"], r["seq"])
    flops = model_flops_per_token(cfg, r["seq"])
    square = flops + attention_flops(r["seq"], cfg.dim) * cfg.n_layers
    return tokens_s, tokens_s * flops / peak, tokens_s * square / peak


def line(r: dict, device: str) -> str:
    label = f"{r['side']}{' compiled' if r['compile'] else ''}"
    if r.get("oom"):
        return f"| {label} | {r['seq']} | {r['tokens']:,} | out of memory | | | | | | |"
    tokens_s, util, square = mfu(r, device)
    back = f"{r['back_to_back'] * 1000:.0f}" if "back_to_back" in r else "-"
    return (f"| {label} | {r['seq']} | {r['tokens']:,} ({r['micro']}) | {statistics.median(r['times']) * 1000:.0f} | "
            f"{back} | {tokens_s:,.0f} | {util:.1%} | {square:.1%} | "
            f"{r['peak_gb']:.1f} | {r['loss_first']:.3f} -> {r['loss_last']:.3f} |")


def report(path: str, write: bool) -> None:
    data = json.loads(Path(path).read_text())
    rows = [line(r, data["device"]) for r in data["results"]]
    body = "\n".join([
        f"Command: `{data.get('command', 'python bench/gpu.py --seq 2048 8192 --micro 1 4 --out DIR')}` (on the "
        "GPU), then `python bench/gpu.py --report DIR/gpu.json --write`  ",
        f"Device: {data['device']}, torch {data['torch']}, MFU against 989 TFLOP/s dense bf16  ",
        "",
        "| side | seq | tokens/step (micro-batches) | ms/step (median) | ms/step back to back | tokens/s | MFU | "
        "MFU, full square | peak GB | loss first -> last step |",
        "|---|---|---|---|---|---|---|---|---|---|", *rows])
    print(body)
    sys.path.insert(0, str(ROOT / "bench"))
    from common import write_doc
    write_doc("gpu", "Single GPU: throughput and MFU", body, write)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--config", default=str(ROOT / "configs" / "llama3-1b.yaml"))
    p.add_argument("--tokens", type=int, default=16384, help="tokens per micro-batch")
    p.add_argument("--micro", type=int, nargs="+", default=[1], help="micro-batches per step (each a list entry)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--chunk", type=int, default=4096, help="sixfold's model.loss_chunk")
    p.add_argument("--recompute", default="none")
    p.add_argument("--sides", nargs="+", default=["sixfold", "hf"],
                   help="sixfold, hf; NAME:0 or NAME:1 without or with torch.compile")
    p.add_argument("--out", default="gpu-bench")
    p.add_argument("--report", help="a gpu.json to put into docs/benchmarks.md")
    p.add_argument("--write", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="with --worker: print the kernels of two more steps and the device's idle gaps")
    p.add_argument("--trace", help="with --profile: the Chrome trace of those steps into this file")
    p.add_argument("--worker", choices=("sixfold", "hf"), help="(internal)")
    p.add_argument("--compile", default="true", help="(internal)")
    p.add_argument("--result", help="(internal)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="with --worker sixfold: more config overrides (data.source=DIR, ...)")
    p.add_argument("--tree", help="with --worker: the sixfold of this checkout instead (another commit's, for an A/B "
                                  "with one harness)")
    args = p.parse_args()
    if args.tree:
        sys.path.insert(0, str(Path(args.tree).resolve()))
    if args.report:
        report(args.report, args.write)
    elif args.worker:
        args.seq, args.micro, args.compile = args.seq[0], args.micro[0], args.compile == "true"
        worker(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
