"""Generation: the KV cache changes nothing, sampling is seeded, eot and max_seq_len stop it."""
import pytest
import torch

from sixfold.config import ModelConfig
from sixfold.data import BPETokenizer, ByteTokenizer
from sixfold.generate import continued, generate, pick, sample_text
from sixfold.model.llama import KVCache, Llama, init_weights
from helpers import torchrun

PROMPT = [5, 17, 200, 3, 64]


def tiny(max_seq_len: int = 64) -> Llama:
    # a wide init gives peaked logits, so argmax is not decided by rounding
    model = Llama(ModelConfig(vocab_size=320, max_seq_len=max_seq_len, init_std=0.3))
    init_weights(model, seed=0)
    return model


@torch.no_grad()
def greedy_without_cache(model: Llama, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


def test_greedy_cache_equals_recompute():
    model = tiny()
    out = generate(model, PROMPT, 20)
    assert len(out) == 20
    assert out == greedy_without_cache(model, PROMPT, 20)


def test_last_token_logits_are_the_whole_sequences_last():
    """Generation makes the logits of each sequence's last token only (a prompt's [s, vocab] never)."""
    model, x = tiny(), torch.randint(0, 320, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        last, whole = model(x, last=True), model(x)
    assert last.shape == (2, 1, 320) and torch.allclose(last, whole[:, -1:], rtol=0, atol=1e-5)


def test_the_cache_is_made_once_as_long_as_generation_may_reach():
    """Each token's keys and values are written into the layer's tensors, not copied with those before them."""
    model = tiny()
    cache = KVCache(model.cfg.n_layers, len(PROMPT) + 3)
    with torch.no_grad():
        model(torch.tensor([PROMPT]), cache, last=True)
        held = cache.k[0].data_ptr()
        for token in (1, 2, 3):
            model(torch.tensor([[token]]), cache, last=True)
        assert cache.k[0].data_ptr() == held and cache.k[0].shape[2] == cache.length == len(PROMPT) + 3
        with pytest.raises(ValueError, match="the KV cache holds 8 tokens; 9 were given"):
            model(torch.tensor([[4]]), cache)


def test_a_kv_cache_larger_than_memory_is_refused_with_its_size():
    """The cache is made before the first forward, as long as generation may reach: one that cannot be allocated is
    said with its size and what to change, not as the allocator's failure."""
    model = tiny(max_seq_len=2**44)
    with pytest.raises(ValueError, match=r"max_new_tokens=17592186044411: the KV cache for 17592186044416 tokens "
                                         r"\(the prompt's 5 and those new\) takes 8,388,608.00 GiB for 2 layers' "
                                         r"keys and values in float32, more than the cpu of the rank holding them "
                                         r"has free; give fewer new tokens"):
        generate(model, PROMPT, 2**44 - 5)


def test_a_model_whose_logits_are_not_finite_is_refused_with_why():
    model = tiny()
    with torch.no_grad():
        model.norm.weight[3] = float("nan")
    for temperature in (0.0, 0.8):
        with pytest.raises(ValueError, match="logits for new token 1 are not all finite"):
            generate(model, PROMPT, 5, temperature=temperature)


def test_negative_counts_are_refused():
    with pytest.raises(ValueError, match="max_new_tokens=-1 must be at least 0"):
        generate(tiny(), PROMPT, -1)
    with pytest.raises(ValueError, match=r"top_k=-2 must be at least 0 \(0: every token\)"):
        generate(tiny(), PROMPT, 3, temperature=1.0, top_k=-2)


def test_sampling_is_seeded():
    model = tiny()
    a = generate(model, PROMPT, 20, temperature=1.0, seed=1)
    assert a == generate(model, PROMPT, 20, temperature=1.0, seed=1)
    assert a != generate(model, PROMPT, 20, temperature=1.0, seed=2)
    assert generate(model, PROMPT, 20, temperature=1.0, top_k=1, seed=2) == generate(model, PROMPT, 20)
    for tiny_t in (1e-40, 1e-300):  # not NaN (1e-300 is 0 in fp32)
        assert generate(model, PROMPT, 20, temperature=tiny_t, seed=2) == generate(model, PROMPT, 20)
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="must be 0 \\(greedy\\) or a positive number"):
            generate(model, PROMPT, 1, temperature=bad)


def test_top_k_keeps_k_tokens_when_logits_tie():
    """Of tokens tied with the k-th most likely, only k are drawn from: top-k 1 is one token, as greedy is."""
    g, tied = torch.Generator().manual_seed(0), torch.tensor([0.0, 2.0, 2.0, 2.0, -1.0])
    assert len({pick(tied, 1.0, 1, g) for _ in range(50)}) == 1
    assert len({pick(tied, 1.0, 2, g) for _ in range(50)}) == 2


def test_top_p_keeps_the_fewest_most_likely_tokens_that_reach_it():
    """As transformers' top_p: probabilities 0.5, 0.3, 0.2 keep the first at p 0.5, two at 0.6, all three at 0.81;
    a tiny p is greedy."""
    g, logits = torch.Generator().manual_seed(0), torch.tensor([0.5, 0.3, 0.2]).log()
    for p, kept in ((0.5, {0}), (0.6, {0, 1}), (0.81, {0, 1, 2}), (1.0, {0, 1, 2})):
        assert {pick(logits, 1.0, 0, g, p) for _ in range(100)} == kept, p
    model = tiny()
    assert generate(model, PROMPT, 10, temperature=1.0, seed=3, top_p=1e-9) == generate(model, PROMPT, 10)
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="must be above 0 and at most 1"):
            generate(model, PROMPT, 1, top_p=bad)


def test_stops_at_eot():
    model = tiny()
    full = generate(model, PROMPT, 20)
    eot = full[5]
    assert generate(model, PROMPT, 20, stop={eot}) == full[:full.index(eot) + 1]


def test_respects_max_seq_len():
    model = tiny(max_seq_len=12)
    out = generate(model, PROMPT, 100)
    assert len(PROMPT) + len(out) == 12
    assert out == greedy_without_cache(model, PROMPT, 7)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, list(range(13)), 1)


def test_sample_text_starts_with_prompt():
    text = sample_text(tiny(), ByteTokenizer(), "def ", 10, seed=4)
    assert text.startswith("def ") and len(text) > 4


def test_ids_beyond_the_tokenizer_are_never_drawn():
    """A vocabulary padded beyond the tokenizer's (320 against the byte tokenizer's 257): an untrained model's
    logits there are as high as anywhere, and those ids would decode to nothing."""
    model = tiny()
    drawn = [t for seed in range(5) for t in generate(model, PROMPT, 30, temperature=1.0, seed=seed)]
    assert max(drawn) >= 257  # the model alone draws them
    kept = [t for seed in range(5) for t in generate(model, PROMPT, 30, temperature=1.0, seed=seed, vocab=257)]
    assert max(kept) < 257 and max(generate(model, PROMPT, 30, vocab=257)) < 257 <= max(generate(model, PROMPT, 30))


def test_a_continuation_keeps_the_space_a_llama_2_tokenizer_drops_when_it_decodes():
    """Sentencepiece-style tokens ("▁world") decode without their leading space on their own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok.train_from_iterator(["hello world and more words"] * 20,
                            trainers.BpeTrainer(vocab_size=100, special_tokens=["<s>", "</s>"], show_progress=False))
    tok = BPETokenizer(tok, "llama2-style")
    prompt, ids = tok.encode("hello"), tok.encode(" world")
    assert tok.decode(ids) == "world" and continued(tok, "hello", prompt, ids) == "hello world"
    byte = ByteTokenizer()
    assert continued(byte, "def ", byte.encode("def "), byte.encode("f(x)")) == "def f(x)"


@pytest.mark.parametrize("layout", [["model.moe_experts=4", "parallel.dp_shard=2", "parallel.ep=2", "parallel.zero=3"],
                                    ["parallel.cp=2", "parallel.zero=3"]], ids=["zero3-ep2-moe", "cp2-zero3"])
def test_the_sample_of_a_parallel_layout_is_one_processs_and_gathers_each_unit_once(layout):
    """Under ZeRO-3 the run's sample gathers the weights once, not for each token: as many gathers for 2 new tokens
    as for 8 (tests/workers/generate_layouts.py)."""
    proc = torchrun("generate_layouts.py", 2, *layout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "rank 0 gathers (calls, bytes) by new tokens: {2: {'fsdp/all_gather': (4, " in proc.stdout, proc.stdout
