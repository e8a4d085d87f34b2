"""The trainer loop: one global batch per step, micro-batches, data-parallel reduction, AdamW."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import socket
import time
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from . import checkpoint as ckpt
from . import ledger, train_state
from .comm import Comm
from .config import (DTYPES, Config, ConfigError, DataConfig, check_available, check_bpe_size, check_tensorboard,
                     PICTURES, shown)
from .console import console
from .determinism import make_deterministic, unsupported
from .data import (BatchLoader, BPETokenizer, ByteTokenizer, DataError, TokenData, eval_batches, load_data,
                   with_tokenizer)
from .logs import RunLog
from .errors import CommError, OutOfMemory, PeerStopped, TrainingError, on_every_rank, out_of_memory
from .generate import prompt_ids, sample_text
from .mesh import ParallelContext
from .model.hf import carried_files, end_ids, imported
from .model.llama import Llama, init_weights, no_decay
from .optim import AdamW, clip_scale, learning_rate
from .model.moe import MoE, routing_warning
from .parallel.context import ContextParallel
from .parallel.expert import ExpertParallel
from .parallel.pipeline import schedules
from .parallel.pipeline.runtime import Pipeline
from .parallel.pipeline.stages import split_stages
from .parallel.sharding import Sharded
from .parallel.tensor import IGNORE_INDEX, TensorParallel
from .pictures import draw_pictures
from .run_dir import check_same_config, claim_run_dir, resume_path, same_resume, start_run_dir
from .staging import to_device
from .stop import SIGNAL_NAMES, StopSignal, Stopped
from .trace import Tracer, overlap_table, write_chrome_trace
from .utilization import Utilization

TRACE_STEPS = 3


# train.* settings of the learning-rate schedule and AdamW: a resume that changes them is told so
SCHEDULE = ("steps", "lr", "min_lr", "warmup_steps", "schedule", "decay_steps", "weight_decay", "beta1", "beta2",
            "eps", "grad_clip")


class Trainer:
    def __init__(self, cfg: Config, ctx: ParallelContext, data: TokenData | None = None):
        """`data`: the corpus of cfg.data, if this process has loaded it already."""
        self.cfg, self.ctx = cfg, ctx
        t = cfg.train
        self.run_dir = Path(cfg.log.run_dir)
        self.tracer = Tracer(False, ctx.rank)
        self.comm = Comm(ctx, self.tracer)
        self.utilization = Utilization(cfg, ctx.device, ctx.world_size)
        self.data = data if data is not None else self._load_data()
        if ctx.world_size > 1:
            self._check_same_data_everywhere()
        with warnings.catch_warnings():
            if not ctx.is_main:  # what every rank would say, said once
                warnings.simplefilter("ignore")
            check_inputs(cfg, self.data)
        torch.manual_seed(t.seed)
        if t.deterministic:
            make_deterministic(t.compile)
        p = cfg.parallel
        tp = TensorParallel(self.comm, p.sequence_parallel)
        self.cp = ContextParallel(self.comm, p.cp_mode, p.cp_zigzag)
        stages = split_stages(cfg.model, p.pp * p.pp_virtual_stages, t.seq_len)
        schedule = schedules.build(p.pp_schedule, p.pp, p.pp_virtual_stages, t.micro_batches) if p.pp > 1 else None
        mine = [s for s in stages if schedule is None or schedule.placement[s.index] == ctx.rank_in("pp")]
        self.model = self._build(lambda: Llama(cfg.model, tp, self.cp, mine, ExpertParallel(self.comm)).to(ctx.device))
        init_weights(self.model, t.seed)
        self.moe = {int(n.split(".")[1]): m for n, m in self.model.named_modules() if isinstance(m, MoE)}
        if t.compile:
            self.model.compile_blocks()
        for said in (routing_warning(cfg.model), p.inert()):
            if ctx.is_main and said:
                warnings.warn(said)
        for m in self.moe.values():
            m.micro_batches = t.micro_batches
        self.sharded = Sharded(self.model, self.comm, p.zero, p.reshard,
                               getattr(torch, DTYPES[t.precision]), getattr(torch, DTYPES[t.grad_reduce]))
        self.pipeline = Pipeline(self.model, schedule, self.comm, self.sharded, self.tracer) if schedule else None
        self.optim = AdamW(self.sharded, t, no_decay)
        self.loader = BatchLoader(self.data.train, t.seq_len, t.global_batch, t.seed,
                                  ctx.batch_index, ctx.size("batch"), self.data.shift, self._eot)
        self.step = self.skipped = 0
        self.saver = train_state.Saver(ctx, self.comm, cfg)
        self.carried: dict[str, bytes] = {}  # hf.CARRIED files of the checkpoint it started from, kept in its own
        self.started_from: Path | None = None  # that checkpoint
        resume = resume_path(cfg)
        if ctx.world_size > 1:
            same_resume(resume, cfg, ctx)
        if resume:
            self.load(resume)
        self.started_at = self.step

    def _load_data(self):
        """The corpus: read (and tokenized into the cache) by this machine's first rank, then by the others."""
        def load():
            if int(os.environ.get("LOCAL_RANK", 0)) == 0:
                return load_data(data_settings(self.cfg))
            with warnings.catch_warnings():  # the first rank of this machine has shown them
                warnings.simplefilter("ignore")
                return load_data(data_settings(self.cfg))
        return self.ctx.local_first(load)

    def _local(self, x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor | None) -> tuple:
        """A batch's tokens and labels cut to this rank's part of each sequence under cp, then on its device, and its
        document ids (data.document_mask) of the whole sequences, left on the CPU (ContextParallel.document_mask)."""
        return to_device(self.cp.shard(x), self.ctx.device), to_device(self.cp.shard(y), self.ctx.device), ids

    @property
    def _eot(self) -> int | None:
        """The end of text whose positions batches give as document ids, with data.document_mask."""
        return self.data.tokenizer.eot if self.cfg.data.document_mask else None

    # one step ---------------------------------------------------------------------------------
    def train_step(self) -> dict:
        t = self.cfg.train
        start = time.perf_counter()
        with self.tracer.span("data", "data"):
            cut = [(self.cp.shard(x), self.cp.shard(y), ids)
                   for x, y, ids in self.loader.micro_batches(self.step, t.micro_batches)]
            # counted before the labels go to the device: reading a count back from it would wait for the last step
            local_tokens = sum(int((y != IGNORE_INDEX).sum()) for _, y, _ in cut)
            micro = [(to_device(x, self.ctx.device), to_device(y, self.ctx.device), ids) for x, y, ids in cut]
        (global_tokens,) = self.comm.sum_scalars([local_tokens], "loss")
        empty = global_tokens == 0  # a batch of prompts only (data.jsonl_prompt_field): skipped, not 0 / 0
        global_tokens = max(global_tokens, 1)
        if self.pipeline:
            loss_sum = self.pipeline.step(micro, global_tokens)
        else:
            loss_sum = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
            for i, (x, y, ids) in enumerate(micro):
                last = i == len(micro) - 1
                if last or t.reduce_each_micro_batch:
                    self.sharded.reduce_when_done(reversed(self.sharded.units), last=last)
                with self.tracer.span(f"F{i}", "compute", mb=i):
                    loss = self.model.loss_sum(x, y, ids) / global_tokens
                with self.tracer.span(f"B{i}", "compute", mb=i):
                    loss.backward()
                if not last and t.reduce_each_micro_batch:
                    self.sharded.end_micro_batch()
                loss_sum += loss.detach()
        self.sharded.finish()
        loss_value = self._total(float(loss_sum), of_step=True)
        with self.tracer.span("optimizer", "optim"):
            grad_norm = math.sqrt(self.sharded.grad_norm_sq())
            lr = learning_rate(t, self.step)
            bad = not (math.isfinite(loss_value) and math.isfinite(grad_norm))
            skip = bad or empty
            if not skip:  # ZeRO-3 gathers what the next step begins with as it goes, if a step comes next
                ahead = self.step + 1 < t.steps and not self._eval_due(self.step + 1)
                self.optim.step(lr, functools.partial(self.sharded.publish, ahead=ahead),
                                clip_scale(grad_norm, t.grad_clip))
            self.sharded.zero_grad()
        self.step += 1
        if bad:
            self.skipped += 1
        elif not empty:  # (a batch of prompts only leaves the count of non-finite steps as it was)
            self.skipped = 0
        self.loader.load_state_dict({**self.loader.state_dict(), "next_step": self.step})
        if self.skipped > t.skip_nonfinite:
            self.saver.wait()  # a background save of a step before them, in place (and named below)
            raise on_every_rank(TrainingError(
                f"loss {loss_value}, gradient norm {grad_norm} at step {self.step}: not finite for {self.skipped} "
                f"step(s) in a row (train.skip_nonfinite={t.skip_nonfinite}); the run stops here. Lower train.lr or "
                f"check the data, then {self._go_back()}"))
        if bad and self.ctx.is_main:
            warnings.warn(f"step {self.step}: loss {loss_value}, gradient norm {grad_norm}; step skipped, weights "
                          f"unchanged ({self.skipped} of at most train.skip_nonfinite={t.skip_nonfinite} in a row)")
        elif empty and self.ctx.is_main:
            warnings.warn(f"step {self.step}: its batch holds prompts only, no token to learn (data.jsonl_prompt_field)"
                          f"; step skipped, weights unchanged")
        elapsed = time.perf_counter() - start
        expert_load = self._expert_load()
        tokens_per_s = t.global_batch * t.seq_len / elapsed
        mfu = self.utilization.mfu(tokens_per_s)
        return {"step": self.step, "loss": math.nan if empty else loss_value, "grad_norm": grad_norm, "lr": lr,
                "skipped": skip, "tokens_per_s": tokens_per_s, "step_s": elapsed,
                **({"mfu": mfu} if mfu is not None else {}),
                "peak_mem_gb": self.utilization.peak_memory_gb(),
                "comm_bytes": self.comm.ledger.end_step(self.step), **expert_load}

    def _eval_due(self, step: int) -> bool:
        """Whether the validation loss is computed after step `step`."""
        t = self.cfg.train
        return bool(t.eval_every) and (step % t.eval_every == 0 or step == t.steps)

    def _expert_load(self) -> dict:
        """The step's MoE losses (balancing + z, summed over layers) and each layer's least and most loaded
        expert's share of the routed tokens."""
        if not self.cfg.model.moe_experts:
            return {}
        aux = sum(float(m.aux) for m in self.moe.values())
        if self.model.tp.sequence:
            (aux,) = self.comm.sum_scalars([aux], "tp")
        layers = self.cfg.model.moe_layers
        counts = torch.zeros(len(layers), self.cfg.model.moe_experts, dtype=torch.float64, device=self.ctx.device)
        for row, i in enumerate(layers):
            if i in self.moe:  # this stage's layers; the other stages fill theirs
                counts[row] = self.moe[i].counts
        self.comm.all_reduce(counts, "pp", label="expert counts")
        shares = counts / counts.sum(-1, keepdim=True)
        spread = torch.stack([shares.amin(-1), shares.amax(-1)], -1).tolist()  # one copy from the device
        for m in self.moe.values():
            m.counts.zero_()
            m.aux.zero_()
        return {"moe_loss": self._total(aux), "expert_share": dict(zip(layers, spread))}

    @torch.no_grad()
    def evaluate(self, stop: StopSignal | None = None) -> float | None:
        """The validation loss; not traced (the trace and its overlap table are the training steps'). With `stop`,
        None once a rank has received a signal (asked before each batch, by all ranks together)."""
        t = self.cfg.train
        batches = eval_batches(self.data.val, t.seq_len, t.global_batch, t.eval_batches,
                               self.ctx.batch_index, self.ctx.size("batch"), self.data.shift, self._eot)
        losses, counts = [], []  # read once all batches are launched: the host does not wait for each
        tracing, self.tracer.enabled = self.tracer.enabled, False
        try:
            for batch in batches:
                if stop is not None and self._stop_heard(stop):
                    self.sharded.release()
                    return None
                x, y, ids = self._local(*batch)
                losses.append(self.pipeline.forward(x, y, documents=ids) if self.pipeline else
                              self.model.loss_sum(x, y, ids))
                counts.append((y != IGNORE_INDEX).sum())
            total, count = self.comm.sum_scalars([sum(map(float, losses)), sum(map(int, counts))], "loss")
            self.sharded.release()  # ZeRO-3 holds no whole model between steps
        finally:
            self.tracer.enabled = tracing
        return total / count if count else float("nan")  # (windows of prompts only: no token to count)

    def _total(self, loss: float, of_step: bool = False) -> float:
        """A step's loss from this rank's part: summed over the loss group, and from the last pipeline stage. The
        step's (`of_step`) under pipelining carries the count of ranks whose compute failed in the step: then all
        stop with the error (Pipeline.stop)."""
        failed = [float(self.pipeline.failed is not None)] if of_step and self.pipeline else []
        loss, *failed = self.comm.sum_scalars([loss, *failed], "loss")
        if self.pipeline:
            loss, *failed = self.comm.sum_scalars([loss, *failed], "pp")
        if any(failed):
            self.pipeline.stop(self.step + 1)
        return loss

    # checkpoints ------------------------------------------------------------------------------
    def save(self) -> Path:
        meta, blobs = {}, {}
        if self.ctx.is_main:
            meta = {"step": self.step, "config": self.cfg.to_dict(), "loader": self.loader.state_dict(),
                    "optimizer_steps": self.optim.step_count, "layout": self.cfg.parallel.describe(),
                    "data": self._data_identity()}
            tok = self.data.tokenizer
            blobs = {"tokenizer.json": tok.to_json().encode(), **self.carried} if isinstance(tok, BPETokenizer) else {}
        return self.saver.save(self.step, train_state.pieces(self.sharded, self.optim), meta, blobs)

    def load(self, where: str) -> None:
        """Resume from a checkpoint; a rank that cannot read its part, or cannot go on from it, stops every rank with
        its message (a rank reads only the files that hold its slices). Ranks done first wait for the others however
        long they read, checking in with them. The weights go to the compute copies (ZeRO-1/2
        gather them) only once every rank has read its part: a rank that had stopped would not take part."""
        def attempt() -> tuple:
            try:
                self._load(where)
                return ("", ckpt.CheckpointError, ckpt.file_sha256(self.started_from / ckpt.META),
                        f"{self.started_from.resolve()} on {socket.gethostname()}")
            except (ckpt.CheckpointError, DataError) as e:
                return str(e), type(e), "", ""
            except OSError as e:  # its meta.json, read again for its identity
                return f"cannot read {e.filename}: {e.strerror or e}", ckpt.CheckpointError, "", ""

        problem, kind, identity, found = self.ctx.all_at_once(attempt, "the ranks reading the checkpoint")
        if self.ctx.world_size > 1:  # (a class travels as its name)
            problems = self.ctx.all_gather_objects((problem, kind, identity, found))
            first = next((r for r, (p, *_) in enumerate(problems) if p), None)
            if first is not None:
                problem, kind = problems[first][:2]
                if any(p != problem for p, *_ in problems):  # (not the same on every rank: say whose)
                    problem += f" (rank {first})"
            elif (other := next((r for r, got in enumerate(problems) if got[2] != problems[0][2]), None)) is not None:
                problem = (f"rank {other} resumes from {problems[other][3]}, rank 0 from {problems[0][3]}: another "
                           f"checkpoint (its meta.json differs); every rank resumes from the same one: give "
                           f"checkpoint.resume a path that all machines share, or the same copy on each")
        if problem:
            raise on_every_rank(kind(problem))
        self.sharded.publish_all()

    def _load(self, where: str) -> None:
        with warnings.catch_warnings():  # what finding it warns of, said once
            if not self.ctx.is_main:
                warnings.simplefilter("ignore")
            checkpoint = ckpt.Checkpoint(where)
        self.started_from = checkpoint.path
        meta = checkpoint.meta
        own = _tokenizer_name(checkpoint)
        if own == self.data.tokenizer.name:  # its tokenizer's and generation's settings stay with the tokenizer
            # (on every rank: the sample's end tokens end a generation that each rank runs)
            self.carried = carried_files(checkpoint)
        where = checkpoint.path / ckpt.META
        if "optimizer_steps" in meta and not checkpoint.index("optim"):
            raise ckpt.CheckpointError(f"{where} is a training checkpoint's and its index holds no optimizer state; "
                                       f"{ckpt.NOT_OURS}")
        if checkpoint.index("optim"):  # a training checkpoint: resumed, on the same tokens
            ckpt.require(meta, {"step": int, "optimizer_steps": int, "loader": dict}, where)
            ckpt.require(meta["loader"], {"next_step": int, "seed": int, "seq_len": int, "global_batch": int}, where,
                         "loader.")
            if "data" in meta:
                self._check_same_data(meta["data"])
        if train_state.load(checkpoint, self.sharded, self.optim, self.cfg):
            self.optim.set_step_count(meta["optimizer_steps"])
            order = self.loader.load_state_dict(meta["loader"])
            self.step = meta["step"]
            if order and self.ctx.is_main:  # a longer context or a larger batch: allowed, but said
                named = ", ".join(f"train.{k}={b} (the checkpoint's run: {a})" for k, (a, b) in order.items())
                warnings.warn(f"resuming {checkpoint.path} with {named}: from step {self.step + 1} the batches follow "
                              f"the order of these settings, in which windows trained on before may come again; set "
                              f"them as the checkpoint's run had them to resume it exactly")
            diffs = train_state.differences(meta, self.cfg, "train")
            changed = {k: v for k, v in diffs.items() if k in SCHEDULE}
            if changed and self.ctx.is_main:  # allowed (a lower lr after a divergence, more steps), but said
                named = ", ".join(f"train.{k}={shown(b)} (the checkpoint's run: {shown(a)})"
                                  for k, (a, b) in changed.items())
                then = replace(self.cfg.train, **{k: a for k, (a, _) in changed.items()})
                now = learning_rate(self.cfg.train, self.step)
                if self.step >= then.steps:  # a step the checkpoint's run did not have
                    lr = (f"; the learning rate of step {self.step + 1} is {now:.3g} (the checkpoint's run ended at "
                          f"step {then.steps}, at {learning_rate(then, then.steps - 1):.3g})")
                else:
                    before = learning_rate(then, self.step)
                    lr = (f"; the learning rate of step {self.step + 1} is {now:.3g} ({before:.3g} in the checkpoint's "
                          f"run)") if now != before else ""
                warnings.warn(f"resuming {checkpoint.path} with {named}: the learning-rate schedule and AdamW go "
                              f"on with the new values from step {self.step + 1}{lr}")
            weights = {k: v for k, v in train_state.differences(meta, self.cfg).items() if k in train_state.OBJECTIVE}
            if weights and self.ctx.is_main:
                named = ", ".join(f"model.{k}={shown(b)} (the checkpoint's run: {shown(a)})"
                                  for k, (a, b) in weights.items())
                warnings.warn(f"resuming {checkpoint.path} with {named}: the run trains on the new objective from "
                              f"step {self.step + 1}")
            mask = train_state.differences(meta, self.cfg, "data").get("document_mask")
            if mask and self.ctx.is_main:
                warnings.warn(f"resuming {checkpoint.path} with data.document_mask={shown(mask[1])} (the checkpoint's "
                              f"run: {shown(mask[0])}): from step {self.step + 1} a token attends to "
                              f"{'its own document only' if mask[1] else 'every earlier token'}; set "
                              f"data.document_mask={shown(mask[0])} to resume it exactly")
            micro = diffs.get("micro_batches")
            if micro and self.cfg.model.moe_experts and self.cfg.model.moe_aux_weight and self.ctx.is_main:
                warnings.warn(f"resuming {checkpoint.path} with train.micro_batches={micro[1]} (the checkpoint's run: "
                              f"{micro[0]}): an MoE layer's load-balancing loss is taken per micro-batch, so from "
                              f"step {self.step + 1} the run trains on another objective; set "
                              f"train.micro_batches={micro[0]} to go on as it would have")
        elif self.ctx.is_main:  # weights only (an imported model): other settings are allowed, but said
            changed = train_state.function_changes(meta, self.cfg)
            if changed:
                named = ", ".join(f"model.{k}={shown(b)} (the checkpoint's: {shown(a)})"
                                  for k, (a, b) in changed.items())
                warnings.warn(f"this run has {named}: the weights of {checkpoint.path} compute another function "
                              f"with them; set those as the checkpoint has them to train on from the same model")
            if imported(meta):
                self._check_imported_tokenizer(checkpoint, own)

    def _check_imported_tokenizer(self, checkpoint: ckpt.Checkpoint, own: str | None) -> None:
        """Warn when a model imported from Hugging Face is trained with another tokenizer than its own (named
        `own`), which gives its token ids other meanings."""
        tokenizer = self.cfg.data.tokenizer
        if own:
            if self.data.tokenizer.name != own:
                warnings.warn(f"{checkpoint.path} holds the tokenizer its model was imported with, and data.tokenizer="
                              f"{tokenizer} gives its token ids other meanings; set data.tokenizer=bpe to train "
                              f"with the one it holds")
        elif tokenizer in ("byte", "bpe"):
            warnings.warn(f"{checkpoint.path} holds weights imported from Hugging Face without their tokenizer, and "
                          f"data.tokenizer={tokenizer} gives their token ids other meanings; set data.tokenizer to "
                          f"the model's tokenizer.json to train on from what it learned")

    def _data_identity(self) -> dict:
        """The tokenizer, and the training split's length and a digest of 4,096 tokens spread evenly over it."""
        train = self.data.train
        spread = train[:: max(len(train) // 4096, 1)][:4096]
        return {"tokenizer": self.data.tokenizer.name, "train_tokens": len(train),
                "train_sample": hashlib.sha256(np.ascontiguousarray(spread, dtype=np.int64).tobytes()).hexdigest()}

    def _check_same_data_everywhere(self) -> None:
        """Every rank read the tokens rank 0 did: a machine with another copy of data.source (or another tokenizer
        file) would train on other batches than the others, in silence."""
        found = self.ctx.all_gather_objects(self._data_identity())
        for rank, other in enumerate(found):
            if other != found[0]:
                raise on_every_rank(DataError(
                    f"rank {rank} read other data than rank 0 ({other['train_tokens']:,} training tokens with "
                    f"tokenizer {other['tokenizer']}, against {found[0]['train_tokens']:,} with "
                    f"{found[0]['tokenizer']}, or the same count of other tokens): give every machine the same "
                    f"data.source files and data.tokenizer"))

    def _check_same_data(self, saved: dict) -> None:
        """Resume on the tokens the checkpoint was trained on: another tokenizer is refused (its ids mean other
        text to the model); other training text is allowed, with a warning that the sample order changes."""
        now = self._data_identity()
        if saved.get("tokenizer") != now["tokenizer"]:
            raise DataError(f"the checkpoint was trained with the tokenizer {saved.get('tokenizer')!r} and this "
                            f"run's data.* settings give {now['tokenizer']!r}; set data.tokenizer (and data.source, "
                            f"data.bpe_vocab_size) as the checkpoint's config.yaml has them")
        length = saved.get("train_tokens") != now["train_tokens"]
        other = saved.get("train_sample", now["train_sample"]) != now["train_sample"]  # (older checkpoints: none)
        if (length or other) and self.ctx.is_main:
            how = f"{saved.get('train_tokens')} tokens, now {now['train_tokens']}" if length else \
                "as many tokens, but other ones"
            warnings.warn(f"the training data differ from the checkpoint's ({how}): from here the samples are not "
                          f"those the first run would have drawn")

    # the loop ---------------------------------------------------------------------------------
    def fit(self) -> list[dict]:
        cfg, t = self.cfg, self.cfg.train
        log = RunLog(self.run_dir, self.ctx.is_main, t.steps, self.step, cfg.log.progress, cfg.log.tensorboard)
        history, began = [], time.perf_counter()
        if self.step >= t.steps and self.ctx.is_main:
            warnings.warn(f"the run resumes at step {self.step} and train.steps={t.steps}: no step left to train; "
                          f"raise train.steps to train on")
        with StopSignal() as stop:
            try:
                while self.step < t.steps:
                    self.tracer.enabled = cfg.log.trace and self.step >= t.steps - TRACE_STEPS
                    self.tracer.step = self.step + 1
                    self.comm.ledger.close("other")  # since the last step: checkpoints, the stop check, loading
                    m = self._step_in_memory()
                    m["elapsed_s"] = time.perf_counter() - began
                    if self._eval_due(self.step):
                        val = self.evaluate(stop)
                        if val is not None:
                            m["val_loss"] = val
                        self.comm.ledger.close("eval")
                    history.append(m)
                    log.step(m, show=self.step % cfg.log.every == 0 or self.step == t.steps)
                    # none while steps are skipped as not finite: the weights may have diverged, and such
                    # checkpoints would push the good ones out of checkpoint.keep
                    due = cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 and not self.skipped and (
                        self.step < t.steps or not cfg.checkpoint.save_final)
                    if due:
                        self.save()
                    heard = self._stop_heard(stop, log.problem)
                    if heard:
                        raise on_every_rank(self._stopped(due, heard))
                self.tracer.enabled = False
                log.end_progress()
                self.sharded.settle()
                again = not history and ckpt.step_dir(self.run_dir, self.step).is_dir()  # no step, nothing new
                final = None
                if cfg.checkpoint.save_final and not again:
                    if not self.skipped:
                        saved = final = self.save()
                        self.saver.wait()  # a background save: said once it is in place
                        log.print(f"checkpoint: {saved}")
                    elif self.ctx.is_main:  # as during the streak: the weights may have diverged
                        warnings.warn(f"no final checkpoint: {self._not_finite()}")
                self.saver.wait()
                if heard := self._stop_heard(stop):  # at the last step's end or during the final save
                    raise on_every_rank(Stopped(
                        f"stopped by {heard} after the last step ({self.step} of {t.steps}), its checkpoint (if any) "
                        f"written; no sample and no summaries (ledger, trace) written", heard))
                self.comm.ledger.close("other")  # the last step's stop check, the final checkpoint
                if cfg.log.sample_tokens:  # every rank: under ZeRO-3 each forward gathers weights from all
                    text = self.sample(stop)  # which a signal cuts short: checked by all after each token
                    log.print("sample:\n" + text + (f"\n(cut short by {heard})" if (heard := stop.heard) else ""))
                    self.comm.ledger.close("sample")
                if history:  # else the last run's ledger and trace stay
                    self._write_outputs(log)
                if heard := stop.heard or stop.received:  # during the sample, or while the summaries were written
                    done = [*([f"its checkpoint {final}"] if final else []), *(["its summaries"] if history else [])]
                    cut = " (the sample cut short)" if stop.heard else ""
                    stopped = Stopped(f"stopped by {heard} at the run's end{cut}"
                                      f"{', ' + ' and '.join(done) + ' written' if done else ''}", heard)
                    raise on_every_rank(stopped) if stop.heard else stopped
            except (CommError, PeerStopped) as e:  # a rank died or hangs: what there is to go on from
                e.args = (f"{e} {self._kept()}",)
                raise
            finally:
                log.close()
        return history

    def _stop_heard(self, stop: StopSignal, problem: str = "") -> str:
        """The signal any rank has received ("" if none; SIGTERM over SIGINT over SIGHUP): each one's summed over the
        world once a step, so that all stop after the same step (counted in the ledger's "other" phase, outside the
        steps). With them, whether a rank could not write the step's metrics (`problem`): then every rank raises
        that rank's TrainingError."""
        heard, (any_failed,) = self._heard_with(stop, [float(bool(problem))])
        failed = (problem if self.ctx.world_size == 1 else self.ctx.first_problem(problem)) if any_failed else ""
        if failed:
            self.saver.wait()  # a background save, in place to go on from
            raise on_every_rank(TrainingError(f"{failed}; make room there (or set log.run_dir elsewhere), then run "
                                              f"the same command with checkpoint.resume=auto to go on from the last "
                                              f"checkpoint"))
        return heard

    def _heard_with(self, stop: StopSignal, values: list[float]) -> tuple[str, list[float]]:
        """The signal any rank has received ("" if none; SIGTERM over SIGINT over SIGHUP), and `values` summed over
        the world, in one collective."""
        if self.ctx.world_size == 1:
            return stop.received, values
        sums = self.comm.sum_scalars([float(stop.received == n) for n in SIGNAL_NAMES] + values, "world")
        return next((name for name, n in zip(SIGNAL_NAMES, sums) if n > 0), ""), sums[len(SIGNAL_NAMES):]

    def _stopped(self, saved: bool, signal_name: str) -> Stopped:
        """The end of a run stopped by a signal: the step's checkpoint (unless `saved` already, checkpoints are off,
        or the step was skipped as not finite) written, and the error saying how to go on."""
        c, done = self.cfg.checkpoint, f"stopped by {signal_name} after step {self.step} of {self.cfg.train.steps}"
        self.sharded.settle()  # no weight gather left in flight
        if not (c.every or c.save_final):
            return Stopped(f"{done}; no checkpoint written (checkpoint.every=0, checkpoint.save_final=false)",
                           signal_name)
        if self.skipped:
            return Stopped(f"{done}; no checkpoint written: {self._not_finite()}", signal_name)
        path = ckpt.step_dir(self.run_dir, self.step) if saved else self.save()
        self.saver.wait()
        return Stopped(f"{done}; checkpoint {path}: run the same command with checkpoint.resume=auto (or "
                       f"checkpoint.resume={path}) to go on", signal_name)

    def _build(self, make):
        """make(), its running out of memory a ConfigError naming the model's size and what to change."""
        try:
            return make()
        except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
            if not out_of_memory(e):
                raise
            n = self.cfg.model.num_params()
            raise ConfigError(f"rank {self.ctx.rank} ran out of memory building the model ({n:,} parameters, "
                              f"{4 * n / 1e9:,.1f} GB in fp32 before any sharding): choose smaller model.* settings "
                              f"or split it over more ranks (parallel.zero=3, tp, pp); `sixfold plan` estimates a "
                              f"layout's memory") from None

    def _step_in_memory(self) -> dict:
        """train_step(), its running out of memory (or into an operation train.deterministic cannot run) a
        TrainingError (OutOfMemory) naming what to change and what was saved."""
        try:
            return self.train_step()
        except (MemoryError, RuntimeError) as e:
            if said := unsupported(e):
                raise TrainingError(f"{said}. {self._kept()}") from None
            if not out_of_memory(e):
                raise
            t = self.cfg.train
            raise OutOfMemory(
                f"rank {self.ctx.rank} ran out of memory in step {self.step + 1} ({t.global_batch} sequences of "
                f"{t.seq_len} tokens a step in {t.micro_batches} micro-batch(es)); hold less at once: raise "
                f"train.micro_batches, set model.recompute=full (or selective), shard more (parallel.zero=3, tp, pp, "
                f"cp) or lower train.seq_len; `sixfold plan` estimates a layout's memory. {self._kept()}") from None

    def _kept(self) -> str:
        """What a run that fails here has to go on from."""
        done = ckpt.complete_steps(self.run_dir)
        return f"The newest checkpoint, {done[-1]}, stays (checkpoint.resume=auto goes on from it)." if done else \
            "No checkpoint of this run was written."

    def _not_finite(self) -> str:
        """Why no checkpoint is written at the end of non-finite steps, and what to do."""
        return (f"the last {self.skipped} step(s) were not finite; lower train.lr or check the data, then "
                f"{self._go_back()}")

    def _go_back(self) -> str:
        """Where to start again after non-finite steps: the run's newest checkpoint before them (the weights in
        memory may be diverged already, so none is written during them), or from the start."""
        first = self.step - self.skipped + 1
        done = [p for p in ckpt.complete_steps(self.run_dir) if ckpt.step_of(p) < first]
        start = self.started_from
        if start and self.started_at < first and (start / ckpt.META).is_file() and start.resolve() not in {
                p.resolve() for p in done}:  # another directory's: older than this run's own
            done.insert(0, start)
        if not done:
            every = self.cfg.checkpoint.every
            why = f"checkpoint.every={every} wrote none before step {first}" if every else \
                "set checkpoint.every to keep some along the way"
            return f"start again: this run has no checkpoint from before them to resume from ({why})"
        earlier = (f" (should it fail the same way, the update of its own step may be what diverged: then "
                   f"checkpoint.resume={done[-2]})" if len(done) > 1 else "")
        return f"resume from the newest checkpoint before step {first}: checkpoint.resume={done[-1]}{earlier}"

    def sample(self, stop: StopSignal | None = None) -> str:
        """The end-of-run sample; with `stop`, every rank's token is rank 0's, and the sample is cut short once any
        rank has received a signal (stop.heard)."""
        log = self.cfg.log

        def agree(token: int) -> int | None:
            """Rank 0's token on every rank (replicas that drew another would leave the others waiting in the
            check), or None once any rank has received a signal."""
            stop.heard, (token,) = self._heard_with(stop, [float(token) if self.ctx.is_main else 0.0])
            return None if stop.heard else int(token)

        return sample_text(self.pipeline or self.model, self.data.tokenizer, log.sample_prompt, log.sample_tokens,
                           seed=self.cfg.train.seed, stop=end_ids(self.carried), agree=agree if stop else None,
                           sharded=self.sharded, settle=self.ctx.first_problem)

    def _write_outputs(self, log: RunLog) -> None:
        """Every rank's ledger in comm_ledger.json and its summary printed; with log.trace, every rank's events in
        trace.json, and the pictures. An earlier launch's trace or pictures that this one did not write over (a run
        resumed in its directory) are removed: `sixfold trace` would draw them as this one's."""
        self.comm.ledger.close("other")
        parts = self.comm.gather_objects(self.comm.ledger.summary(), "world")
        traced = self.comm.gather_objects(self.tracer.events, "world") if self.cfg.log.trace else []  # on rank 0
        # the others wait for rank 0 however long the pictures take (not a collective's parallel.timeout_s)
        self.ctx.main_alone(lambda: self._write_summaries(log, parts, [e for part in traced for e in part]),
                            "rank 0 to write the run's summaries")

    def _write_summaries(self, log: RunLog, parts: list, events: list) -> None:
        """Rank 0: the ledger's `parts`, the trace's `events` and their pictures written, what is stale removed."""
        with _writing_outputs(self.run_dir):
            data = ledger.write(self.run_dir / "comm_ledger.json", parts, self.cfg.parallel.describe())
        log.print(f"{ledger.table(data)}\nledger: {self.run_dir / 'comm_ledger.json'}")
        written, failed = [], []
        if events:
            with _writing_outputs(self.run_dir):
                write_chrome_trace(events, self.run_dir / "trace.json", self.cfg.parallel.describe())
                written = [self.run_dir / "trace.json", *draw_pictures(self.run_dir, self.cfg, failed)]
            log.print(f"{overlap_table(events)}\ntrace: {written[0]}; pictures: {', '.join(map(str, written[1:]))}")
            if failed:  # the training and its files are whole: said, and the run ends as it would have
                log.print(f"warning: not drawn: {'; '.join(failed)}; `sixfold trace {self.run_dir}` draws the "
                          f"pictures again from the run's files")
        if stale := [p for n in ("trace.json", *PICTURES) if (p := self.run_dir / n) not in written and p.is_file()]:
            with _writing_outputs(self.run_dir):
                for path in stale:
                    path.unlink()
            log.print(f"removed {', '.join(p.name for p in stale)}: an earlier launch of this run wrote them, this "
                      f"one did not")


@contextlib.contextmanager
def _writing_outputs(run_dir: Path):
    """After the training and its final checkpoint: a summary that cannot be written (a full disk) is a
    TrainingError that says so."""
    try:
        yield
    except OSError as e:
        raise TrainingError(f"cannot write the run's summaries (comm_ledger.json, trace.json, pictures) in {run_dir}: "
                            f"{e}; the training and its checkpoints are done; make room there to have them next "
                            f"time") from e


def _tokenizer_name(checkpoint: ckpt.Checkpoint) -> str | None:
    """The name of the tokenizer.json a checkpoint holds, if it holds one."""
    if "tokenizer.json" not in checkpoint.meta["files"]:
        return None
    return BPETokenizer.from_json(checkpoint.blob("tokenizer.json").decode(), str(checkpoint.path)).name


def data_settings(cfg: Config) -> DataConfig:
    """cfg.data; but with data.tokenizer=bpe, a run resuming a checkpoint that holds its trained tokenizer reads
    that one: trained again on a changed corpus, BPE would give the model's token ids other meanings. A checkpoint
    that is not there, or a tokenizer of bytes or a BPE to be trained that the model's vocabulary cannot hold, is
    refused before the corpus is read."""
    resume = resume_path(cfg)
    if resume:
        _look_for(cfg, resume)
    if cfg.data.tokenizer == "byte":
        _check_vocab(cfg, ByteTokenizer.vocab_size)
    if cfg.data.tokenizer != "bpe":
        return cfg.data
    if resume:
        try:
            with warnings.catch_warnings():  # said again where the checkpoint is loaded
                warnings.simplefilter("ignore")
                checkpoint = ckpt.Checkpoint(resume)
        except ckpt.CheckpointError:  # refused where it is loaded
            return cfg.data
        if "tokenizer.json" in checkpoint.meta.get("files", {}):  # not a byte-level run's, nor an imported model's
            return with_tokenizer(cfg.data, checkpoint.blob("tokenizer.json"))
    check_bpe_size(cfg)
    return cfg.data


def _check_vocab(cfg: Config, tokens: int) -> None:
    """Refuse a model vocabulary smaller than the tokenizer's `tokens`."""
    if tokens > cfg.model.vocab_size:
        resume = resume_path(cfg)  # its embeddings are that many
        fix = f"train from {resume} with the tokenizer it was trained with (data.tokenizer=bpe reads the one it " \
              f"holds, if it holds one)" if resume else f"set model.vocab_size>={tokens}"
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {tokens} tokens "
                          f"(data.tokenizer={cfg.data.tokenizer}); {fix}")


def check_inputs(cfg: Config, data: TokenData) -> None:
    """Refuse what the config and the data alone show cannot run, before any step (and, from `sixfold train`,
    before its ranks start): a vocabulary smaller than the tokenizer's, a split too short for one sequence, a
    sample prompt longer than the model takes, a checkpoint to resume from that is not there. Warn of a train split
    shorter than one batch, of evaluation batches that go round the val split and of a sample longer than the
    model holds."""
    t = cfg.train
    _check_vocab(cfg, data.tokenizer.vocab_size)
    try:
        samples = BatchLoader(data.train, t.seq_len, t.global_batch, t.seed).samples
    except DataError as e:  # where the val split took the tokens, lowering its share is the fix too
        if not len(data.val):
            raise
        raise DataError(f"{e}; or lower data.val_fraction={cfg.data.val_fraction:g}: the val split holds "
                        f"{len(data.val):,} tokens") from None
    if samples < t.global_batch:
        warnings.warn(f"the train split holds {samples} sequence(s) of train.seq_len={t.seq_len} tokens, fewer than "
                      f"train.global_batch={t.global_batch}: every batch holds some of them more than once; add data, "
                      f"or lower train.global_batch or train.seq_len")
    if t.eval_every:
        eval_batches(data.val, t.seq_len, t.global_batch, 1)
        windows = (len(data.val) - 1) // t.seq_len
        if (t.eval_batches - 1) * t.global_batch >= windows:
            warnings.warn(f"train.eval_batches={t.eval_batches} batches of {t.global_batch} sequences go round the "
                          f"val split's {windows} sequences more than once: {-(-windows // t.global_batch)} batch(es) "
                          f"cover it, in less time")
    if data.shift and t.eval_every and all((y == IGNORE_INDEX).all() for _, y, _ in eval_batches(
            data.val, t.seq_len, t.global_batch, t.eval_batches, shift=data.shift)):
        warnings.warn(f"the validation's {t.eval_batches} batch(es) hold prompts only (data.jsonl_prompt_field): its "
                      f"loss, which counts answers only, is nan; raise data.val_fraction or train.eval_batches")
    prompt = len(prompt_ids(data.tokenizer, cfg.log.sample_prompt)) if cfg.log.sample_tokens else 1
    room = cfg.model.max_seq_len - prompt
    if room < 0:
        raise ConfigError(f"log.sample_prompt is {prompt} tokens, more than model.max_seq_len={cfg.model.max_seq_len} "
                          f"that the sample after training may hold; shorten it, or set log.sample_tokens=0")
    if cfg.log.sample_tokens > room:
        warnings.warn(f"log.sample_tokens={cfg.log.sample_tokens}: model.max_seq_len={cfg.model.max_seq_len} leaves "
                      f"room for {room} after log.sample_prompt; the sample after training holds at most {room}")
    if cfg.checkpoint.resume not in ("", "auto"):
        _look_for(cfg, cfg.checkpoint.resume)


def _look_for(cfg: Config, path: str) -> None:
    """Refuse a checkpoint that is not there, naming the setting that gave it; what finding it warns of is said
    where it is loaded."""
    given = cfg.checkpoint.resume
    setting = "checkpoint.resume" if given not in ("", "auto") or path != cfg.checkpoint.init else "checkpoint.init"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ckpt.find_checkpoint(path)
        except ckpt.CheckpointError as e:
            raise ckpt.CheckpointError(f"{setting}: {e}") from None


def run(cfg: Config, ctx: ParallelContext, data: TokenData | None = None) -> list[dict]:
    """Train in the ranks of `ctx` (and with `data`, if loaded already)."""
    with contextlib.ExitStack() as held:
        check_same_config(cfg, ctx)
        claim_run_dir(cfg, ctx, held)
        if ctx.is_main and cfg.log.progress:
            console(functools.partial(print, flush=True), f"sixfold: {cfg.parallel.describe()} on {ctx.world_size} "
                    f"process(es), {ctx.backend}, {cfg.model.num_params():,} parameters\n--- config ---\n"
                    f"{cfg.to_yaml()}--------------")
        trainer = Trainer(cfg, ctx, data)
        if ctx.is_main and cfg.log.progress:
            said = [f"data: {trainer.data.summary}"] if trainer.data.read else []
            if trainer.started_from:
                said.append(f"from checkpoint {trainer.started_from}: step {trainer.step} of {cfg.train.steps}")
            elif cfg.checkpoint.resume == "auto":
                said.append(f"checkpoint.resume=auto: {cfg.log.run_dir} holds no checkpoint yet; the run starts from "
                            f"new weights")
            if said:
                console(functools.partial(print, flush=True), "\n".join(said))
        start_run_dir(cfg, ctx, trainer.step)
        history = trainer.fit()
        ctx.barrier()  # the ranks leave together: none tears down its groups while a peer still uses them
    return history


def train(cfg: Config) -> list[dict]:
    """Run training in this process (one rank of a torchrun job, or alone)."""
    check_available(cfg)
    check_tensorboard(cfg)
    ctx = ParallelContext.initialize(cfg.parallel)
    try:
        return run(cfg, ctx)
    finally:
        ctx.close()
