"""Runs a pipeline schedule on this rank: the forwards, backwards and deferred weight gradients of the stages it holds,
in the schedule's order, with activations and their gradients passed between ranks.

Each run of sends and receives between two computes is posted at once; a receive is waited for only by the compute
that uses its data, a run's sends once they are known received (delivery.py; the wait returns at once and frees what
they held) or else at the end of the step (the simulator's default model, in which it proves every schedule
deadlock-free) on gloo, whose sends complete without their receives. On gloo a run's receives are posted one compute
earlier, each on its own, before the data can have arrived: posted after it, a receive blocks the call while the
sender, busy computing, hands it over (up to 8 ms on a shared CPU). NCCL runs a group's operations in order on one
stream, and a large send completes only once its receive runs: there a run's sends and receives go as one batch
(`together`), where the schedule places the run, which the simulator's batched model proves deadlock-free (posted
apart, two ranks' crossing sends, each queued before its receive, would wait for each other). Shapes are known
ahead: every micro-batch has the same [tokens, dim] hidden state (this rank's cp and sequence-TP part), so no
metadata travels. A B that sends its input gradient and has no W of its own (Schedule.sends_early) defers its weight
gradient as for a W and computes it right after posting that send, so the rank before starts its B sooner. A unit's
gradient reduction starts as its stage's last backward or weight-gradient action of the step (or an early sender's
weight gradient) completes it, in reverse unit order; with ZeRO-3 the weights are gathered once per step.

A compute that raises (an operation train.deterministic refuses, memory) stops this rank's computes, not its
messages: the rest of the step sends zeros where it would have sent data, receives and starts the reductions as
planned, so that no other stage waits parallel.timeout_s for it. The step ends on every rank, and the trainer's
loss sum carries the failure to all, which then stop with this rank's error (`stop`).
"""
from __future__ import annotations

from collections import defaultdict

import torch

from ...comm import Comm
from ...determinism import unsupported
from ...errors import CommError, PeerStopped, out_of_memory
from ...trace import Tracer
from ..sharding import Sharded
from .delivery import delivered
from .schedules import B, COMPUTE, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, Schedule


class Pipeline:
    def __init__(self, model, schedule: Schedule, comm: Comm, sharded: Sharded, tracer: Tracer):
        self.model, self.schedule, self.comm, self.sharded, self.tracer = model, schedule, comm, sharded, tracer
        self.together = comm.ctx.backend != "gloo"  # a run's receives in the batch of its sends
        self.rank = comm.ctx.rank_in("pp")
        self.place = schedule.placement
        self.stages = {s.index: s for s in model.stages}
        self.last = schedule.stages - 1
        self.actions = schedule.ranks[self.rank]
        self.split = schedule.split(self.rank)
        self.early = schedule.sends_early(self.rank)
        model.tp.weight_grads.used = bool(self.split or self.early)
        self.launch_after = self._launch_points()
        self.delivered = delivered(schedule, self.rank)
        # the index of each compute action, the run of sends and receives before each, and the run after the last
        self.computes = [i for i, a in enumerate(self.actions) if a.kind in COMPUTE]
        starts = [0] + [i + 1 for i in self.computes]
        self.runs = [self.actions[a:b] for a, b in zip(starts, self.computes)], self.actions[starts[-1]:]
        self.peak_in_flight = 0  # in the last step: most (stage, micro) pairs whose saved activations were alive
        self.deferred = 0  # in the last step: weight gradients computed by W actions
        self.sent_early = 0  # in the last step: B actions that sent their input gradient before their weight gradient
        self.failed: Exception | None = None  # in the last step: this rank's error in a compute
        self.failed_stage = 0  # and the stage it ran

    @property
    def cfg(self):
        return self.model.cfg

    @property
    def device(self) -> torch.device:
        return self.comm.ctx.device

    def __call__(self, tokens: torch.Tensor, cache=None, last: bool = False) -> torch.Tensor:
        return self.forward(tokens, cache=cache, last=last)

    def _launch_points(self) -> dict[int, list]:
        """Action index -> the units whose gradients for the step are complete after it, last unit first."""
        model, finals = self.model, {}
        for i, a in enumerate(self.actions):
            if a.kind in (B, W):
                finals[a.stage] = i
        out = defaultdict(list)
        for unit in self.sharded.units:
            if unit.modules[0] is model.embed:
                touching = [s for s in self.stages.values() if s.embed or (s.head and model.head is None)]
            elif unit.modules[0] is model.norm:
                touching = [s for s in self.stages.values() if s.head]
            else:  # a block, or its experts: "layers.<i>...."
                layer = int(unit.names[0].split(".")[1])
                touching = [s for s in self.stages.values() if layer in s.layers]
            out[max(finals[s.index] for s in touching)].insert(0, unit)  # the order a backward completes them
        return out

    def _hidden(self, t) -> torch.Tensor:
        """An empty buffer for one micro-batch's hidden state (or its gradient) on this rank."""
        b, s = t.shape
        tokens = b * s // self.model.tp.size if t.sequence_tp else b * s
        return torch.empty(tokens, self.model.cfg.dim, dtype=self.sharded.units[0].full.dtype,
                           device=self.comm.ctx.device)

    def _send(self, batch: list, outbox: dict, sending: list, receives: list = (),
              arriving: dict | None = None) -> None:
        """Post a run's sends as one batch, added to `sending` with the sends it holds; `receives` (_buffers'
        for the same run) in that batch too, each put in `arriving`."""
        sends = [a for a in batch if a.kind in (SEND_F, SEND_B)]
        if sends or receives:
            tensors = [(outbox.pop((a.kind, a.stage, a.micro)), self.schedule.peer(a)) for a in sends]
            label = " ".join(map(repr, sends + [a for a, _, _ in receives]))
            pending = self.comm.exchange(tensors, [(buf, peer) for _, buf, peer in receives], "pp", label=label)
            if sends:
                sending.append((pending, set(sends)))
            for a, _, _ in receives:
                arriving[a.kind, a.stage, a.micro] = pending

    def _let_go(self, recv: Action, sending: list, known: set) -> None:
        """After `recv`'s data arrived: wait for (at once) and drop the batches of sends now all known received."""
        if recv in self.delivered:
            known.update(self.delivered[recv])
            for batch in [b for b in sending if b[1] <= known]:
                batch[0].wait()
                sending.remove(batch)

    def _buffers(self, batch: list, t, inputs: dict, grads: dict) -> list[tuple[Action, torch.Tensor, int]]:
        """A buffer for each receive of a run, put in `inputs` or `grads`: (receive, buffer, peer)."""
        out = []
        for a in batch:
            if a.kind in (RECV_F, RECV_B):
                key, buf = (a.stage, a.micro), self._hidden(t)
                if a.kind == RECV_F:
                    inputs[key] = buf.requires_grad_()
                else:
                    grads[key] = buf
                out.append((a, buf, self.schedule.peer(a)))
        return out

    def _receive(self, batch: list, t, inputs: dict, grads: dict, arriving: dict) -> None:
        """Post a run's receives, one each into `arriving`, so that a compute waits only for its own."""
        for a, buf, peer in self._buffers(batch, t, inputs, grads):
            arriving[a.kind, a.stage, a.micro] = self.comm.exchange([], [(buf, peer)], "pp", label=repr(a))

    def step(self, micro: list[tuple], scale: float) -> torch.Tensor:
        """Forward and backward of every micro-batch (tokens, labels, document ids or None) by the schedule; the
        losses are divided by `scale`. Returns this rank's summed loss (zero off the last stage). A compute that
        raises is kept in `failed` (see the module's doc), the step's messages passed all the same."""
        self.sharded.gather_all()
        self.sharded.alloc_grads()
        model, wg = self.model, self.model.tp.weight_grads
        t = model.tokens(*micro[0][0].shape, micro[0][0].device)
        each = [model.in_documents(t, ids) for _, _, ids in micro]  # one set of rotary tables for all
        inputs, outputs, grads, outbox, deferred, sending, arriving, known = {}, {}, {}, {}, {}, [], {}, set()
        self.peak_in_flight = self.deferred = self.sent_early = 0
        self.failed = blank = None
        loss = torch.zeros((), dtype=torch.float64, device=self.comm.ctx.device)
        runs, tail = self.runs
        self._receive(runs[0], t, inputs, grads, arriving)  # runs[0] sends nothing: no compute has run
        for k, i in enumerate(self.computes):
            a = self.actions[i]
            after, late = runs[k + 1] if k + 1 < len(runs) else tail, None
            if not self.together and k + 1 < len(runs):
                self._receive(runs[k + 1], t, inputs, grads, arriving)
            s, m = key = (a.stage, a.micro)
            stage = self.stages[s]
            recv = Action(RECV_F if a.kind == F else RECV_B, s, m)
            received = arriving.pop((recv.kind, s, m), None) if a.kind != W else None
            if received:  # the data this compute uses, posted earlier
                received.wait()
                self._let_go(recv, sending, known)
            due, early = self.launch_after.get(i), a.kind == B and key in self.early
            if due and (self.failed or not early):  # a W reports only its deferred weights; an early sender's units,
                # below; after a failure, all of the action's at once (reduce_due): in the planned order still
                self.sharded.reduce_when_done(due, _weights(deferred[key]) if a.kind == W and not self.failed else None)
            try:
                if not self.failed:
                    with self.tracer.span(f"{a.kind}{m}", "compute", mb=m, stage=s):
                        if a.kind == F:
                            out = model.run(stage, micro[m][0] if stage.embed else inputs[key], each[m])
                            if stage.head:
                                out = model.loss(out, micro[m][1], t.sequence_tp) / scale
                                loss += out.detach()
                            elif self.place[s + 1] == self.rank:
                                inputs[s + 1, m] = out.detach().requires_grad_()
                            else:
                                outbox[SEND_F, s, m] = out.detach()
                            outputs[key] = out
                            self.peak_in_flight = max(self.peak_in_flight, len(outputs) + len(deferred))
                        elif a.kind == B:
                            wg.defer, wg.head = key in self.split or early, key in self.split  # the head: under a W
                            out = outputs.pop(key)
                            out.backward(None if stage.head else grads.pop(key))
                            wg.defer = wg.head = False
                            if key in self.split:
                                deferred[key] = wg.take()
                            if not stage.embed:
                                grad = inputs.pop(key).grad
                                if self.place[s - 1] == self.rank:
                                    grads[s - 1, m] = grad
                                else:
                                    outbox[SEND_B, s, m] = grad
                            if early:
                                late = wg.take()
                        else:
                            work = deferred.pop(key)
                            self.deferred += len(work)
                            wg.run(work)
                        out = grad = work = None  # what was sent is held only by its send (counted so: held_sends);
                        # a W's products freed now, not at the next W
            except CommError:  # (a collective inside a compute: tp, cp, ep) the messages cannot go on
                raise
            except Exception as e:
                self._fail(e, s, due if early else None)
            if self.failed:  # zeros in place of what this rank would have sent (one buffer: sends only read it)
                blank = self._hidden(t).zero_() if blank is None else blank
                for send in after:
                    if send.kind in (SEND_F, SEND_B):
                        outbox.setdefault((send.kind, send.stage, send.micro), blank)
            self._send(after, outbox, sending, self._buffers(after, t, inputs, grads) if self.together else [],
                       arriving)
            if late is not None:  # an early sender's weight gradient, once its input gradient is on its way
                self.sent_early += 1
                if due:  # its units complete as these weights are reported
                    self.sharded.reduce_when_done(due, _weights(late))
                if late:  # (a stage of the head alone has none)
                    with self.tracer.span(f"W{m}", "compute", mb=m, stage=s):
                        try:
                            wg.run(late)  # emptying it: each product freed as the next is made
                        except CommError:
                            raise
                        except Exception as e:
                            self._fail(e, s)
            if due:
                self.sharded.reduce_due()
        if not self.together:
            self._receive(tail, t, inputs, grads, arriving)
        for pending, _ in sending:
            pending.wait()
        return loss

    def _fail(self, error: Exception, stage: int, due: list | None = None) -> None:
        """A compute of `stage` raised `error`: the step's other computes are left out. `due`: an early sender's
        units, whose reductions had waited for its weight gradient."""
        wg = self.model.tp.weight_grads
        wg.defer = wg.head = False
        wg.take()
        self.failed, self.failed_stage = error, stage
        if due:
            self.sharded.reduce_when_done(due)

    def stop(self, step: int) -> None:
        """On every rank, after step `step` in which a rank's compute failed: its own error where it failed, else
        PeerStopped naming the first such rank of its loss group and pipeline, and its error."""
        e, said = self.failed, ""
        if e is not None:
            what = unsupported(e) or ("it ran out of memory" if out_of_memory(e) else f"{type(e).__name__}: {e}")
            said = f"rank {self.comm.ctx.rank} (pipeline stage {self.failed_stage}) failed in step {step}: {what}"
        for group in ("loss", "pp"):  # every rank takes part
            said = next((p for p in self.comm.ctx.all_gather_objects(said, group) if p), "")
        if e is not None:
            raise e
        raise PeerStopped(f"{said or f'a rank failed in step {step}'}. Rank {self.comm.ctx.rank} stopped with it at "
                          f"the step's end.")

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None, cache=None, documents=None,
                last: bool = False):
        """One batch through every stage in order, on every pp rank: with labels the loss sum (a float),
        else the full logits [b, s, vocab] (with `last`, [b, 1, vocab]: each sequence's last token's); with
        `documents` (ids [b, S]), attention within each document."""
        self.sharded.gather_all()
        model = self.model
        t = model.tokens(*tokens.shape, tokens.device, cache, documents)
        x = None
        for s in range(self.last + 1):
            if self.place[s] != self.rank:
                continue
            if s > 0 and self.place[s - 1] != self.rank:
                x = self._hidden(t)
                self.comm.exchange([], [(x, self.place[s - 1])], "pp", label="forward").wait()
            x = model.run(self.stages[s], tokens if s == 0 else x, t)
            if s < self.last and self.place[s + 1] != self.rank:
                self.comm.exchange([(x, self.place[s + 1])], [], "pp", label="forward").wait()
        if cache is not None:
            cache.length += tokens.shape[1]
        owner = self.place[self.last] == self.rank
        if labels is not None:
            (total,) = self.comm.sum_scalars([float(model.loss(x, labels, t.sequence_tp)) if owner else 0.0], "pp")
            return total
        shape = (len(tokens), 1 if last else tokens.shape[1], model.cfg.vocab_size)
        logits = model.full_logits(model.logits(*model.head_input(x, t, last))).float().view(shape) if owner else \
            torch.empty(shape, device=tokens.device)
        self.comm.broadcast(logits, "pp", self.place[self.last])
        return logits


def _weights(work: list) -> set[int]:
    """The ids of the weights that deferred weight-gradient work reports."""
    return {id(w) for weights, _ in work for w in weights}
