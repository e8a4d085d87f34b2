"""Autoregressive generation with a KV cache: greedy or temperature / top-k / top-p sampling."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection

import torch

from .config import seed_problem, temperature_problem, top_p_problem
from .errors import on_every_rank, out_of_memory
from .model.llama import KVCache, Llama
from .parallel.pipeline.runtime import Pipeline
from .parallel.sharding import Sharded


def pick(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator, top_p: float = 1.0) -> int:
    """The next token from fp32 CPU logits [vocab]: among the top_k most likely (0: all), then among the fewest most
    likely whose probabilities reach top_p (nucleus sampling, as transformers' top_p)."""
    if temperature == 0:
        return int(logits.argmax())
    # in float64, where any positive temperature is a number (in fp32, 1e-300 is 0): a tiny one tends to greedy
    logits = (logits.double() - logits.max()) / temperature
    if top_k > 0:  # exactly k: of tokens tied with the k-th, those topk takes (a threshold would keep them all)
        top = torch.topk(logits, min(top_k, logits.numel()))
        logits = torch.full_like(logits, float("-inf")).index_copy_(0, top.indices, top.values)
    probs = torch.softmax(logits, -1)
    if top_p < 1:  # those after the first whose cumulative probability reaches top_p are dropped
        ranked, order = probs.sort(descending=True, stable=True)
        probs[order[ranked.cumsum(0) - ranked >= top_p]] = 0
    return int(torch.multinomial(probs, 1, generator=gen))


def prompt_problem(tokens: int, limit: int) -> str:
    """What is wrong with a prompt of `tokens` for a model of max_seq_len `limit`, to follow its name ("" if
    nothing)."""
    return "" if 0 < tokens <= limit else f"{tokens} tokens; give one of 1 to {limit} tokens (the model's max_seq_len)"


@torch.no_grad()
def generate(model: Llama | Pipeline, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0, stop: Collection[int] = (), vocab: int | None = None,
             agree: Callable[[int], int | None] | None = None, top_p: float = 1.0,
             sharded: Sharded | None = None, settle: Callable[[str], str] | None = None) -> list[int]:
    """New tokens after prompt_ids (ending with a stop token if one was drawn); the total stays within max_seq_len.
    `model` is the whole model, or a pipeline run on every one of its ranks. `vocab`: the tokenizer's size, the ids
    from which on (a model's vocabulary padded beyond its tokenizer's) are never drawn. `agree(token)`, asked of each
    token drawn (on every rank alike), gives the token to take, or None to end there. `sharded`: the model's units,
    whose ZeRO-3 weights are then gathered once for the call (Sharded.held), not for every token. `settle(problem)`,
    asked on every rank once its KV cache is made (or refused: `problem`), gives any rank's problem to all ("" for
    none): a rank whose cache does not fit then stops them all, none left waiting in a forward."""
    limit = model.cfg.max_seq_len
    if said := prompt_problem(len(prompt_ids), limit):
        raise ValueError(f"the prompt has {said}")
    if said := temperature_problem(temperature):
        raise ValueError(f"temperature={temperature} {said}")
    if said := top_p_problem(top_p):
        raise ValueError(f"top_p={top_p} {said}")
    if said := seed_problem(seed):
        raise ValueError(f"seed={seed} {said}")
    for name, value in (("max_new_tokens", max_new_tokens), ("top_k", top_k)):
        if value < 0:
            raise ValueError(f"{name}={value} must be at least 0" + (" (0: every token)" if name == "top_k" else ""))
    gen = torch.Generator().manual_seed(seed)
    cache = kv_cache(model, len(prompt_ids), max_new_tokens, settle)
    with sharded.held() if sharded is not None else contextlib.nullcontext():
        return _drawn(model, cache, prompt_ids, max_new_tokens, temperature, top_k, gen, stop, vocab, agree, top_p)


def kv_cache(model: Llama | Pipeline, prompt: int, max_new_tokens: int,
             settle: Callable[[str], str] | None = None) -> KVCache:
    """The KV cache of a generation after `prompt` tokens, made now for as many as it may reach (within max_seq_len)
    on the layers this rank holds; if it does not fit, a ValueError that says how large it is (with `settle`, on
    every rank: generate)."""
    size = min(model.cfg.max_seq_len, prompt + max_new_tokens)
    cache = KVCache(model.cfg.n_layers, size)
    llama = model.model if isinstance(model, Pipeline) else model
    blocks = [block.attn for block in llama.layers.values()]
    dtype = next(llama.parameters()).dtype
    problem = ""
    try:
        for a in blocks:
            cache.make(a.layer, 1, a.n_kv_heads, a.head_dim, dtype, model.device)
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if not out_of_memory(e):
            raise
        cache = None  # the layers' made so far freed, not kept by the traceback
        nbytes = sum(2 * a.n_kv_heads * size * a.head_dim for a in blocks) * dtype.itemsize
        problem = (f"max_new_tokens={max_new_tokens}: the KV cache for {size} tokens (the prompt's {prompt} and "
                   f"those new) takes {nbytes / 2**30:,.2f} GiB for {len(blocks)} layers' keys and values in "
                   f"{str(dtype).removeprefix('torch.')}, more than the {model.device} of the rank holding them has "
                   f"free; give fewer new tokens (sixfold generate --max-new-tokens, the trainer's log.sample_tokens)")
    if settle is not None:
        problem = settle(problem)
    if problem:
        raise on_every_rank(ValueError(problem)) if settle is not None else ValueError(problem)
    return cache


def _drawn(model, cache: KVCache, prompt_ids: list[int], max_new_tokens: int, temperature: float, top_k: int,
           gen: torch.Generator, stop: Collection[int], vocab: int | None, agree, top_p: float) -> list[int]:
    """generate()'s tokens, its arguments checked and its cache made."""
    limit, device = model.cfg.max_seq_len, model.device
    tokens = torch.tensor([prompt_ids], device=device)
    out: list[int] = []
    while len(out) < max_new_tokens and len(prompt_ids) + len(out) < limit:
        logits = model(tokens, cache, last=True)[0, -1, :vocab].float().cpu()
        if not logits.isfinite().all():  # argmax would take a NaN, multinomial fail with no word of why
            raise ValueError(f"the model's logits for new token {len(out) + 1} are not all finite (NaN or inf): its "
                             f"weights hold such values or its activations overflowed; generate from an earlier "
                             f"checkpoint, one saved before the losses went non-finite")
        token = pick(logits, temperature, top_k, gen, top_p)
        if agree is not None and (token := agree(token)) is None:
            break
        out.append(token)
        if out[-1] in stop:
            break
        tokens = torch.tensor([[out[-1]]], device=device)
    return out


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """A prompt's tokens: a special token's text in it is that token (a chat template's markers), as transformers
    encodes a text (and as a prompt-and-answer document is read; in other documents it stays text)."""
    return tokenizer.encode(prompt, specials=True)


def sample_text(model: Llama | Pipeline, tokenizer, prompt: str, max_new_tokens: int, temperature: float = 0.8,
                top_k: int = 40, seed: int = 0, stop: Collection[int] = (),
                agree: Callable[[int], int | None] | None = None, top_p: float = 1.0,
                sharded: Sharded | None = None, settle: Callable[[str], str] | None = None) -> str:
    """The prompt followed by a sampled continuation, which ends at the end of text or a token of `stop` (left
    out), or where `agree` says (generate)."""
    ids = prompt_ids(tokenizer, prompt)
    stop = {tokenizer.eot, *stop}
    out = generate(model, ids, max_new_tokens, temperature, top_k, seed, stop, tokenizer.vocab_size, agree, top_p,
                   sharded, settle)
    if out and out[-1] in stop:
        out = out[:-1]
    return continued(tokenizer, prompt, ids, out)


def continued(tokenizer, prompt: str, prompt_ids: list[int], ids: list[int]) -> str:
    """The prompt and its continuation `ids`, decoded together: a tokenizer that drops a leading space when it
    decodes (Llama 2's) keeps the one between them."""
    both, head = tokenizer.decode(prompt_ids + ids), tokenizer.decode(prompt_ids)
    return prompt + both[len(head):] if both.startswith(head) else both


def checkpoint_tokenizer(source, cfg):
    """The tokenizer a checkpoint (a path, or opened) was trained with: its tokenizer.json, or the byte tokenizer."""
    from .checkpoint import opened
    from .data import BPETokenizer, ByteTokenizer, DataError
    from .model.hf import imported
    checkpoint = opened(source)
    path = checkpoint.path
    if "tokenizer.json" in checkpoint.meta["files"]:
        return BPETokenizer.from_json(checkpoint.blob("tokenizer.json").decode(), str(path / "tokenizer.json"))
    if imported(checkpoint.meta):
        raise DataError(f"{path} holds weights imported from Hugging Face without a tokenizer (its directory had no "
                        f"tokenizer.json that sixfold can use); generate with transformers, or train from it with "
                        f"data.tokenizer set to a tokenizer.json and generate from that run")
    if cfg.data.tokenizer == "byte" and cfg.model.vocab_size >= ByteTokenizer.vocab_size:
        return ByteTokenizer()
    raise DataError(f"{path} holds no tokenizer.json and was not trained with the byte tokenizer")
