"""Context parallelism: each cp rank holds part of every sequence; attention still sees the whole of it.

The sequence is cut into chunks: 2*cp with zigzag balance (rank i holds chunks i and 2*cp-1-i, so every
rank does the same causal-attention work) or cp contiguous ones. Three ways to attend over the whole:
  ring       key/value blocks travel the cp ring (async send/recv overlapped with the current block);
             partial outputs merge exactly through their log-sum-exp; fully masked chunk pairs are
             skipped; in backward dK/dV travel the ring back to their owners;
  allgather  keys and values all-gathered (their gradients reduce-scattered), local queries;
  ulysses    all-to-all from (my tokens, all heads) to (all tokens, my heads), q, k and v in one, and back.
With document masking (model/documents.py) each way takes its mask from `document_mask`, made once per forward;
the ring also skips the chunk pairs in which no query sees a key, and masks only those where causality is not exact.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..comm import Comm
from ..model.causal import ChunkedCausal, causal_attention, chunks_gain, cpu_backward, cpu_forward
from ..model.documents import within_documents
from ..model.visible import Visible
from ..staging import to_device

MODES = ("ring", "allgather", "ulysses")


class ContextParallel:
    """This rank's place in the cp group: which chunks of each sequence it holds, and how it attends."""

    def __init__(self, comm: Comm | None = None, mode: str = "ring", zigzag: bool = True):
        self.comm, self.mode, self.zigzag = comm, mode, zigzag
        self.size = comm.ctx.size("cp") if comm is not None else 1
        self.rank = comm.ctx.rank_in("cp") if comm is not None else 0
        self.n_chunks = 2 * self.size if zigzag else self.size
        self._mask: tuple[tuple, Visible] | None = None  # all-gather KV's last causal mask and what it was for

    def chunks_of(self, rank: int) -> list[int]:
        return [rank, 2 * self.size - 1 - rank] if self.zigzag else [rank]

    @property
    def chunks(self) -> list[int]:
        return self.chunks_of(self.rank)

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of the sequence dimension `dim` (its chunks, in order)."""
        if self.size == 1:
            return t
        pieces = t.chunk(self.n_chunks, dim=dim)
        return torch.cat([pieces[c] for c in self.chunks], dim=dim)

    def positions_of(self, rank: int, local_len: int, device) -> torch.Tensor:
        """Global positions of the tokens a rank holds."""
        n = local_len // len(self.chunks)
        return torch.cat([torch.arange(c * n, (c + 1) * n, device=device) for c in self.chunks_of(rank)])

    def positions(self, local_len: int, device) -> torch.Tensor:
        """Global positions of this rank's tokens."""
        return self.positions_of(self.rank, local_len, device)

    def _in_position_order(self, local_len: int, device) -> torch.Tensor | None:
        """Indices that put every rank's tokens, as gathers deliver them (rank after rank), in the order of their
        positions; None where they are in that order already (contiguous chunks)."""
        if not self.zigzag:
            return None
        return torch.cat([self.positions_of(r, local_len, device) for r in range(self.size)]).argsort()

    def pieces(self, local_len: int) -> list[tuple[int, slice]]:
        """The sequence's chunks in the order of their positions, each as where a gather holds it: (rank, its
        tokens' slice of that rank's local ones)."""
        n = local_len // len(self.chunks)
        where = {c: (r, slice(j * n, (j + 1) * n)) for r in range(self.size) for j, c in enumerate(self.chunks_of(r))}
        return [where[c] for c in range(self.n_chunks)]

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
        """Causal attention of local queries over the whole sequence; q [b, hq, local, d], k/v [b, hkv, local, d].
        With `mask` (document_mask's), each query sees only keys of its own document."""
        if self.mode == "ring":
            return _Ring.apply(q, k, v, self, mask)
        if self.mode == "allgather":
            return self._allgather(q, k, v, mask)
        return self._ulysses(q, k, v, mask)

    def document_mask(self, ids: torch.Tensor, local_len: int, dtype: torch.dtype, device=None, dense: bool = False):
        """What this rank's attention needs to keep each token to its document, from the document ids [b, S] of the
        whole sequences (best on the CPU; the masks are made on `device`): which keys its queries see, in the order of
        their positions (model/visible.py: all of them on one rank and under Ulysses, its own over all under
        all-gather KV); for the ring, per chunk pair (mine, theirs) in which a query sees a key, what ring_masks
        says. `dense`: each whole mask made now (for a compiled block)."""
        if self.size > 1 and self.mode == "ring":
            return ring_masks(self, ids, dtype, device)
        ids = to_device(ids, device)
        whole = torch.arange(ids.shape[1], device=ids.device)
        mine = whole if self.size == 1 or self.mode == "ulysses" else self.positions(local_len, ids.device)
        return Visible(ids, mine, whole, dtype, dense)

    def comm_bytes(self, batch: int, heads: int, kv_heads: int, local: int, head_dim: int,
                   itemsize: int = 4, forward_only: bool = False) -> dict[str, int]:
        """Bytes over the cp group for one attention forward and backward, by op.

        With kv = the bytes of this rank's keys and values (2 * batch * kv_heads * local * head_dim * itemsize):
          ring       cp-1 sends of kv forward; cp-1 of kv and cp of their gradients (in fp32 or wider) backward;
          allgather  an all-gather of cp*kv forward, a reduce-scatter of cp*kv backward;
          ulysses    all-to-alls of q, k, v and the output forward, the same backward (kv heads fewer than cp
                     are first repeated to cp).
        With `forward_only`, the forward's part (what recomputation runs again).
        """
        if self.size == 1:
            return {}
        kv = 2 * batch * kv_heads * local * head_dim * itemsize
        if self.mode == "ring":  # the gradients travel in at least fp32
            grads = 0 if forward_only else self.size * kv * max(itemsize, 4) // itemsize
            return {"send_recv": (self.size - 1 if forward_only else 2 * self.size - 2) * kv + grads}
        if self.mode == "allgather":
            return {"all_gather": self.size * kv, **({} if forward_only else {"reduce_scatter": self.size * kv})}
        q = batch * heads * local * head_dim * itemsize
        kv = kv * max(self.size // kv_heads, 1) if kv_heads % self.size else kv
        return {"all_to_all": (1 if forward_only else 2) * (2 * q + kv)}

    # all-gather KV --------------------------------------------------------------------------------
    def _allgather(self, q, k, v, mask):
        # [2, b, hkv, cp*local, d]: the ranks' chunks gathered in rank order, then put in the order of their positions
        keys = _GatherKV.apply(torch.stack([k, v]), self)
        # attention saves q: a copy of its own (in q's layout, which SDPA's output takes, and the output projection
        # reads without a copy), or q's storage, the heads' buffer, would keep the local k and v too
        q = q.clone()
        mask = self._causal_mask(q) if mask is None else mask
        if chunks_gain(q, masked=True):  # the local queries' positions rise: each chunk reaches a range of keys
            return ChunkedCausal.apply(q, keys[0], keys[1], mask)
        return F.scaled_dot_product_attention(q, keys[0], keys[1], attn_mask=mask.dense(),
                                              enable_gqa=k.shape[1] != q.shape[1])

    def _causal_mask(self, q) -> Visible:
        """The local queries' causal view of the gathered keys, one for every layer: its whole mask, where made,
        is one tensor that attention saves for backward (a bool mask would be converted, and saved, once per
        layer)."""
        n, key = q.shape[2], (q.shape[2], q.device, q.dtype)
        if self._mask is None or self._mask[0] != key:
            whole = torch.arange(self.size * n, device=q.device)
            self._mask = key, Visible(None, self.positions(n, q.device), whole, q.dtype)
        return self._mask[1]

    # Ulysses ---------------------------------------------------------------------------------------
    def _ulysses(self, q, k, v, mask):
        if k.shape[1] % self.size:  # fewer kv heads than cp: each rank receives the one its queries need
            k, v = (t.repeat_interleave(self.size // t.shape[1], dim=1) for t in (k, v))
        order = self._in_position_order(q.shape[2], q.device)
        q, k, v = (t if order is None else t[:, :, order] for t in _ToTokens.apply(self, q, k, v))
        out = causal_attention(q, k, v) if mask is None else within_documents(q, k, v, mask)
        return _ToHeads.apply(out if order is None else out[:, :, order.argsort()], self)


def _heads_to_tokens(xs: list[torch.Tensor], cp: ContextParallel) -> torch.Tensor:
    """Tensors [b, h, local, d] (h of each a multiple of cp) -> [b, sum(h)/cp, cp*local, d]: my group of each one's
    heads, one after another, with every rank's tokens (in rank order); one all-to-all for them all."""
    b, _, n, d = xs[0].shape
    send = torch.cat([x.view(b, cp.size, x.shape[1] // cp.size, n, d).transpose(0, 1) for x in xs], 2)
    out = torch.empty_like(send)
    cp.comm.all_to_all(out, send, "cp", label="ulysses")
    return out.permute(1, 2, 0, 3, 4).reshape(b, send.shape[2], cp.size * n, d)


def _tokens_to_heads(xs: list[torch.Tensor], cp: ContextParallel) -> torch.Tensor:
    """The inverse: tensors [b, hg, cp*local, d] -> [b, cp, sum(hg), local, d], rank r's groups of heads at r, one
    after another."""
    b, _, total, d = xs[0].shape
    n = total // cp.size
    send = torch.cat([x.view(b, x.shape[1], cp.size, n, d).permute(2, 0, 1, 3, 4) for x in xs], 2)
    out = torch.empty_like(send)
    cp.comm.all_to_all(out, send, "cp", label="ulysses")
    return out.transpose(0, 1)


class _ToTokens(torch.autograd.Function):
    """Forward: q, k and v from (my tokens, all heads) to (all tokens, my heads) in one all-to-all; backward: their
    gradients back in one."""

    @staticmethod
    def forward(ctx, cp, *xs):
        ctx.cp, ctx.heads = cp, [x.shape[1] // cp.size for x in xs]
        return _heads_to_tokens(list(xs), cp).split(ctx.heads, 1)

    @staticmethod
    def backward(ctx, *grads):
        back = _tokens_to_heads(list(grads), ctx.cp)  # [b, cp, sum of the groups, local, d]
        b, _, _, n, d = back.shape
        return None, *(g.reshape(b, -1, n, d) for g in back.split(ctx.heads, 2))


class _ToHeads(torch.autograd.Function):
    """Forward: the output from (all tokens, my heads) back to (my tokens, all heads); backward: the inverse."""

    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        back = _tokens_to_heads([x], cp)
        return back.reshape(back.shape[0], -1, *back.shape[3:])

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_tokens([grad], ctx.cp), None


class _GatherKV(torch.autograd.Function):
    """Forward: all-gather of stacked [k, v] along the sequence, put in the order of positions in one copy;
    backward: their gradients put back in rank order in one copy, then reduce-scattered."""

    @staticmethod
    def forward(ctx, kv, cp):
        ctx.cp, ctx.pieces = cp, cp.pieces(kv.shape[3])
        full = kv.new_empty((cp.size * kv.shape[0], *kv.shape[1:]))
        cp.comm.all_gather(full, kv.contiguous(), "cp", label="kv")
        ranks = full.view(cp.size, *kv.shape)
        return torch.cat([ranks[r, :, :, :, tokens] for r, tokens in ctx.pieces], dim=3)

    @staticmethod
    def backward(ctx, grad):
        cp = ctx.cp
        two, b, h, total, d = grad.shape
        ranks = grad.new_empty((cp.size, two, b, h, total // cp.size, d))
        for (r, tokens), piece in zip(ctx.pieces, grad.chunk(len(ctx.pieces), dim=3)):
            ranks[r, :, :, :, tokens] = piece
        out = ranks.new_empty(ranks.shape[1:])
        cp.comm.reduce_scatter(out, ranks.flatten(0, 1), "cp", label="kv grads")
        return out, None


# ring attention ------------------------------------------------------------------------------------
# Per chunk pair, a kernel pair: forward gives the block's output and log-sum-exp; backward, given the merged
# output and log-sum-exp of the query chunk, gives the block's exact share of dq, dk and dv. On a CPU: its
# flash-attention kernels; on a GPU in 16-bit floats: its flash-attention kernels unless a document mask is given
# (they take none); otherwise blockwise math in at least fp32. A mask is a Visible (model/visible.py).
# Queries come grouped [b, hkv, g, n, d] (g query heads per kv head), keys and values [b, hkv, m, d]. Outputs and
# gradients are summed in at least fp32.

def _scores(q, k, causal: bool, scale: float, mask):
    """q [b, hkv, g, n, d] against k [b, hkv, m, d] -> [b, hkv, g, n, m], upper triangle masked if causal."""
    s = torch.einsum("bhgnd,bhmd->bhgnm", q, k) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s if mask is None else s + mask.dense()[:, :, None]


def _wide(*ts):
    return [t.to(_sum_dtype(t.dtype)) for t in ts]


def _math_forward(q, k, v, causal: bool, scale: float, mask=None):
    q, k, v = _wide(q, k, v)
    s = _scores(q, k, causal, scale, mask)
    lse = s.logsumexp(-1)
    return torch.einsum("bhgnm,bhmd->bhgnd", (s - lse[..., None]).exp(), v), lse, None


def _math_backward(dout, delta, q, k, v, out, lse, causal: bool, scale: float, aux, mask=None):
    dout, q, k, v = _wide(dout, q, k, v)
    p = (_scores(q, k, causal, scale, mask) - lse[..., None].to(q.dtype)).exp()
    ds = p * (torch.einsum("bhgnd,bhmd->bhgnm", dout, v) - delta[..., None].to(q.dtype))
    return (torch.einsum("bhgnm,bhmd->bhgnd", ds, k) * scale, torch.einsum("bhgnm,bhgnd->bhmd", ds, q) * scale,
            torch.einsum("bhgnm,bhgnd->bhmd", p, dout))


def _flat(x, g: int):
    """Grouped queries [b, hkv, g, n, d] -> [b, hkv*g, n, d]; keys [b, hkv, m, d] repeated to each query head."""
    if x.dim() == 5:
        return x.flatten(1, 2)
    b, h, m, d = x.shape
    return x[:, :, None].expand(b, h, g, m, d).flatten(1, 2)


def _flash_forward(q, k, v, causal: bool, scale: float, mask=None):
    """Also returns what the backward kernel needs besides tensors (sequence bookkeeping, dropout's seed)."""
    g = q.shape[2]
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        _flat(q, g), _flat(k, g), _flat(v, g), 0.0, causal, False, scale=scale)
    return out.view(q.shape), lse[..., :q.shape[3]].reshape(q.shape[:4]), (cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_backward(dout, delta, q, k, v, out, lse, causal: bool, scale: float, aux, mask=None):
    b, h, g, n, d = q.shape
    m = k.shape[2]
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        _flat(dout, g), _flat(q, g), _flat(k, g), _flat(v, g), _flat(out, g), lse.flatten(1, 2).contiguous(),
        cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
    return dq.view(q.shape), dk.view(b, h, g, m, d).sum(2), dv.view(b, h, g, m, d).sum(2)


def _cpu_forward(q, k, v, causal: bool, scale: float, mask=None):
    """A diagonal pair (causal) or a masked one long enough runs in chunks of queries (model/causal.py cpu_forward):
    a masked pair's chunks reach only the keys of the documents that cross into it."""
    g = q.shape[2]
    out, lse = cpu_forward(_flat(q, g), _flat(k, g), _flat(v, g), causal, mask, scale)
    return out.unflatten(1, (-1, g)), lse.unflatten(1, (-1, g)), None


def _cpu_backward(dout, delta, q, k, v, out, lse, causal: bool, scale: float, aux, mask=None):
    b, h, g, n, d = q.shape
    m = k.shape[2]
    dq, dk, dv = cpu_backward(_flat(dout, g).contiguous(), _flat(q, g), _flat(k, g), _flat(v, g), _flat(out, g),
                              lse.flatten(1, 2).contiguous(), causal, mask, scale)
    return dq.view(q.shape), dk.view(b, h, g, m, d).sum(2), dv.view(b, h, g, m, d).sum(2)


def _kernels(q: torch.Tensor, masked: bool = False):
    if q.device.type == "cpu":
        return _cpu_forward, _cpu_backward
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and not masked:
        return _flash_forward, _flash_backward
    return _math_forward, _math_backward


def _pairs(cp: ContextParallel, owner: int):
    """(my chunk index, owner's chunk index, causal) for the chunk pairs that are not fully masked."""
    mine, theirs = cp.chunks, cp.chunks_of(owner)
    return [(i, j, a == c) for i, a in enumerate(mine) for j, c in enumerate(theirs) if c <= a]


def ring_masks(cp: ContextParallel, ids: torch.Tensor, dtype: torch.dtype, device=None) -> dict:
    """Per chunk pair (mine, theirs) of global chunk indices in which a query sees a key: (which keys its queries
    see, model/visible.py, on `device`; the queries that see no key [b, 1, 1, n]), or (None, None) where causality
    alone is exact. Which pairs those are follows from the documents of each chunk's first and last token (a row's
    ids never fall): given `ids` on the CPU, deciding it does not wait for the device."""
    n = ids.shape[1] // cp.n_chunks
    first, last = ids[:, ::n].cpu(), ids[:, n - 1::n].cpu()  # [b, chunks]
    ids = to_device(ids, device)
    span = torch.arange(n, device=ids.device)
    masks = {}
    for a in cp.chunks:
        for c in range(a + 1):
            if c < a and not (last[:, c] == first[:, a]).any():
                continue  # in every row the keys' documents end before the queries' first begins
            if (first[:, c] == last[:, a]).all():
                masks[a, c] = None, None  # one document in each row holds both chunks
                continue
            seen = Visible(ids, span + a * n, span + c * n, dtype)
            masks[a, c] = seen, seen.blind()
    return masks


def _blocks(cp: ContextParallel, owner: int, masks: dict | None):
    """The chunk pairs to compute with an owner's block, a diagonal one first (every query sees itself there, so the
    log-sum-exp merged into is finite from the start): (i, j, causal, mask, queries that see no key). With document
    masks (ContextParallel.document_mask), a pair in which no query sees a key is left out."""
    out = []
    for i, j, causal in sorted(_pairs(cp, owner), key=lambda p: not p[2]):
        pair = cp.chunks[i], cp.chunks_of(owner)[j]
        if masks is None:
            out.append((i, j, causal, None, None))
        elif pair in masks:
            out.append((i, j, causal, *masks[pair]))
    return out


def _ring_step(cp: ContextParallel, kv: torch.Tensor):
    """Start passing a block to the next rank of the ring; returns the receive buffer and the pending op."""
    nxt, prev = (cp.rank + 1) % cp.size, (cp.rank - 1) % cp.size
    buf = torch.empty_like(kv)
    return buf, cp.comm.exchange([(kv, nxt)], [(buf, prev)], "cp", label="ring")


def _sum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, masks: dict | None):
        b, hq, n, d = q.shape
        hkv, parts, scale = k.shape[1], len(cp.chunks), 1.0 / math.sqrt(d)
        qs = q.view(b, hkv, hq // hkv, parts, n // parts, d).unbind(3)
        out = [None] * parts
        lse = [None] * parts
        ctx.aux = {}  # the kernel's bookkeeping for backward, per causal flag (every chunk pair has one shape)
        kv = torch.stack([k, v]).contiguous()
        for step in range(cp.size):
            pending = _ring_step(cp, kv) if step < cp.size - 1 else None
            ks, vs = (t.chunk(parts, dim=2) for t in kv)
            for i, j, causal, mask, empty in _blocks(cp, (cp.rank - step) % cp.size, masks):
                attend = _kernels(q, mask is not None)[0]
                block_out, block_lse, aux = attend(qs[i], ks[j], vs[j], causal, scale, mask)
                if mask is None:
                    ctx.aux[causal] = aux
                block_out, block_lse = block_out.to(_sum_dtype(q.dtype)), block_lse.to(_sum_dtype(q.dtype))
                if empty is not None:  # its queries that see no key: nothing to add
                    block_out = block_out.masked_fill(empty[..., None], 0)
                    block_lse = block_lse.masked_fill(empty, -math.inf)
                if out[i] is None:
                    out[i], lse[i] = block_out, block_lse
                else:
                    merged = torch.logaddexp(lse[i], block_lse)
                    out[i] = out[i] * (lse[i] - merged).exp()[..., None] + \
                        block_out * (block_lse - merged).exp()[..., None]
                    lse[i] = merged
            if pending is not None:
                kv, work = pending
                work.wait()
        # laid out [b, n, hq, d] as the output projection reads it: the tensor saved here is its input too
        out_t = torch.stack(out, 3).permute(0, 3, 4, 1, 2, 5).to(q.dtype).contiguous().view(b, n, hq, d).transpose(1, 2)
        ctx.cp, ctx.scale, ctx.masks = cp, scale, masks
        ctx.save_for_backward(q, k, v, out_t, torch.stack(lse, 3))  # lse [b, hkv, g, parts, n/parts]
        return out_t

    @staticmethod
    def backward(ctx, dout):
        cp, scale = ctx.cp, ctx.scale
        q, k, v, out, lse = ctx.saved_tensors
        b, hq, n, d = q.shape
        hkv, parts = k.shape[1], len(cp.chunks)
        out = out.view(b, hkv, hq // hkv, parts, n // parts, d)
        dout = dout.reshape(out.shape)
        delta = (dout.to(lse.dtype) * out).sum(-1)
        qs = q.view(b, hkv, hq // hkv, parts, n // parts, d).unbind(3)
        dq = torch.zeros(out.shape, dtype=_sum_dtype(q.dtype), device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=_sum_dtype(q.dtype), device=q.device)
        for step in range(cp.size):
            ahead = _ring_step(cp, kv) if step < cp.size - 1 else None
            ks, vs = (t.chunk(parts, dim=2) for t in kv)
            dks, dvs = (t.chunk(parts, dim=2) for t in dkv)
            for i, j, causal, mask, _ in _blocks(cp, (cp.rank - step) % cp.size, ctx.masks):
                grads = _kernels(q, mask is not None)[1]
                dqi, dk, dv = grads(dout[:, :, :, i], delta[:, :, :, i], qs[i], ks[j], vs[j], out[:, :, :, i],
                                    lse[:, :, :, i], causal, scale,
                                    ctx.aux[causal] if mask is None else None, mask)
                dq[:, :, :, i] += dqi
                dks[j].add_(dk)
                dvs[j].add_(dv)
            # the gradients follow their block; one more hop reaches the owner
            back, pending = _ring_step(cp, dkv) if cp.size > 1 else (dkv, None)
            if ahead is not None:
                kv, work = ahead
                work.wait()
            if pending is not None:
                pending.wait()
            dkv = back
        dkv = dkv.to(q.dtype)
        return dq.to(q.dtype).reshape(b, hq, n, d), dkv[0], dkv[1], None, None
