"""Corpora, tokenizers, token caches and batch order, on real files in tmp_path."""
import json
import os
import re
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from sixfold import data as data_module
from sixfold.config import RUN_CONFIG_HEAD, ConfigError, DataConfig, load_config, make_run_dir
from sixfold import corpus as corpus_module
from sixfold.corpus import iter_documents, split_documents
from sixfold.data import (BatchLoader, BPETokenizer, ByteTokenizer, DataError, build_tokenizer, eval_batches,
                          load_data, with_tokenizer)
from sixfold.parallel.tensor import IGNORE_INDEX

TEXT = "def add(a, b):\n    return a + b  # héllo 🙂\n\nclass Point:\n    x: int = 0\n"


def cfg(tmp_path, **kw) -> DataConfig:
    return DataConfig(cache_dir=str(tmp_path / "cache"), **kw)


def write_corpus(root: Path, n: int = 12) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"doc{i:02d}.txt").write_text(f"# document {i}\n" + TEXT * (i + 1))
    return root


def test_stdlib_documents_are_deterministic(tmp_path):
    c = cfg(tmp_path, max_bytes=300_000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        docs = iter_documents(c)
        again = iter_documents(c)
    assert docs == again and len(docs) > 3
    ids = [d for d, _ in docs]
    assert ids == sorted(ids) and all(i.endswith(".py") and not i.startswith("/") for i in ids)
    assert 299_990 < sum(len(t.encode()) for _, t in docs) <= 300_000
    train, val = split_documents(docs, 0.2)
    assert (train, val) == split_documents(docs, 0.2)
    assert train and val and not {d for d, _ in train} & {d for d, _ in val}
    assert len(train) + len(val) == len(docs)


def test_split_is_stable_when_files_are_added():
    docs = [(f"f{i}.py", "x") for i in range(200)]
    train, val = split_documents(docs, 0.1)
    more_train, more_val = split_documents(docs + [(f"g{i}.py", "x") for i in range(50)], 0.1)
    assert set(val) <= set(more_val) and set(train) <= set(more_train)
    assert split_documents(docs[:2], 0.99)[0] and split_documents(docs[:2], 0.99)[1]


def test_a_corpus_of_few_documents_is_split_by_tokens(tmp_path):
    """Two files: holding one out would take half the text, and none falls to val at 0.01 (forcing one out did):
    the stream's last val_fraction of tokens is val, whichever way the names hash."""
    root = tmp_path / "two"
    root.mkdir()
    for name in ("a.txt", "b.md"):
        (root / name).write_text(TEXT * 20)
    for val_fraction in (0.01, 0.1):
        docs = iter_documents(cfg(tmp_path, source=str(root), val_fraction=val_fraction))
        assert split_documents(docs, val_fraction) == (docs, [])
        data = load_data(cfg(tmp_path, source=str(root), val_fraction=val_fraction))
        total = 2 * (len(TEXT.encode()) * 20 + 1)
        assert len(data.val) == int(total * val_fraction) and len(data.train) + len(data.val) == total
        said = f"2 documents from 2 of 2 files in {root}, their last tokens held out; {len(data.train):,} train and "
        assert data.summary == said + f"{len(data.val):,} val tokens"
        assert load_data(cfg(tmp_path, source=str(root), val_fraction=val_fraction)).summary == data.summary  # cached
    data = load_data(cfg(tmp_path, source=str(root), max_bytes=100))
    assert data.read == f"1 document from 1 of 2 files in {root}, data.max_bytes=100 reached, its last tokens " \
                        "held out"


def test_text_directory_skips_undecodable_and_hidden(tmp_path):
    root = write_corpus(tmp_path / "corpus", 3)
    (root / "sub").mkdir()
    (root / "sub" / "b.txt").write_text("nested")
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / "zeros.dat").write_bytes(bytes(3000))  # valid UTF-8, but binary
    (root / ".hidden").write_text("secret")
    (root / "empty.txt").write_text("")
    with pytest.warns(UserWarning, match="skipped 2 file.*NUL bytes.*latin1.txt, .*zeros.dat"):
        docs = iter_documents(cfg(tmp_path, source=str(root)))
    assert [d for d, _ in docs] == ["doc00.txt", "doc01.txt", "doc02.txt", "sub/b.txt"]


def test_a_text_with_a_stray_byte_is_read_with_a_replacement_character(tmp_path):
    """Up to one byte in 1,000 that is not UTF-8 reads as U+FFFD, each, said once a load (a JSONL file's lines
    too); a file with more is skipped as not UTF-8."""
    root = write_corpus(tmp_path / "corpus", 1)
    (root / "stray.txt").write_bytes(b"a" * 2000 + b"\xe9 \xef\xbf\xbd b")  # the U+FFFD already there stays one
    (root / "stray.jsonl").write_bytes(json.dumps({"text": "x" * 1000}).encode() + b"\n" +
                                       b'{"text": "caf\xe9"}\n')
    (root / "latin1.txt").write_bytes("caf\xe9 " .encode("latin-1") * 200)
    (root / "cut.txt").write_bytes(b"b" * 2000 + b"\xf0\x9f\x98 \xe2\x82")  # 5 bytes in 2,007 (two characters cut)
    for _ in range(2):  # read and cached, then opened from the cache
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load_data(cfg(tmp_path, source=str(root)))
        said = [str(w.message) for w in caught]
        assert any(f"read 2 file(s) with a few bytes that are not UTF-8 (at most 1 in 1,000) as U+FFFD: "
                   f"{root / 'stray.jsonl'} (1), {root / 'stray.txt'} (1)" in w for w in said), said
        assert any("skipped 2 file(s) that are not UTF-8" in w and "cut.txt" in w and "latin1.txt" in w
                   for w in said), said
    docs = dict(iter_documents(cfg(tmp_path, source=str(root))))
    assert docs["stray.txt"] == "a" * 2000 + "\ufffd \ufffd b" and docs["stray.jsonl:2"] == "caf\ufffd"


def test_a_cached_corpus_warns_as_its_first_read_did(tmp_path):
    root = write_corpus(tmp_path / "corpus", 3)
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    for _ in range(2):  # read and cached, then opened from the cache
        with pytest.warns(UserWarning, match="skipped 1 file.*latin1.txt"):
            load_data(cfg(tmp_path, source=str(root)))


def test_bad_sources_raise(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.txt").write_bytes(b"\xff\xfe\xfa")
    with pytest.warns(UserWarning), pytest.raises(DataError, match="no non-empty UTF-8"):
        iter_documents(cfg(tmp_path, source=str(bad)))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no files"):
        iter_documents(cfg(tmp_path, source=str(tmp_path / "empty")))
    with pytest.raises(DataError, match=r"data\.source.*nowhere"):
        load_data(cfg(tmp_path, source=str(tmp_path / "nowhere")))
    os.mkfifo(tmp_path / "pipe")
    for odd in (tmp_path / "pipe", Path("/dev/zero")):
        with pytest.raises(DataError, match=f"{odd} is neither a regular file nor a directory \\(a device, pipe or "
                                            f"socket\\); point data.source at a file"):
            iter_documents(cfg(tmp_path, source=str(odd)))
    mixed = write_corpus(tmp_path / "mixed", 1)
    np.arange(5, dtype=np.uint16).tofile(mixed / "t.bin")
    with pytest.raises(DataError, match="mixes"):
        load_data(cfg(tmp_path, source=str(mixed)))


def test_jsonl_field_and_bad_lines(tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [json.dumps({"body": "first\u2028line"}), "{not json", json.dumps({"other": 1}),
             "", json.dumps({"body": "second"}), json.dumps(["body"])]
    path.write_bytes(b"\xef\xbb\xbf" + ("\n".join(lines) + "\n").encode())  # a byte-order mark, dropped
    with pytest.warns(UserWarning, match=r"data\.jsonl:2: skipped 3 line"):
        docs = iter_documents(cfg(tmp_path, source=str(path), jsonl_field="body"))
    assert docs == [("data.jsonl:1", "first\u2028line"), ("data.jsonl:5", "second")]


def test_a_jsonl_file_of_lines_without_the_field_is_read_keeping_only_the_first_ten_line_numbers(tmp_path):
    """The likeliest mistake, data.jsonl_field naming another field, on a large file: its line numbers were all held
    for the warning (36 bytes a line: gigabytes for a file of 100 million lines)."""
    import tracemalloc
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"text": "one good line"}) + "\n" + '{"content": "x"}\n' * 20_000)
    tracemalloc.start()
    try:
        with pytest.warns(UserWarning, match=re.escape("data.jsonl:2: skipped 20000 line(s) that are not JSON objects "
                                                       "with string field(s) 'text' (data.jsonl_field); lines [2, 3, "
                                                       "4, 5, 6, 7, 8, 9, 10, 11]")):
            assert len(iter_documents(cfg(tmp_path, source=str(path)))) == 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200_000, f"peak {peak:,} bytes"  # (all held: 720 kB)


@pytest.mark.parametrize("name", ["A.JSONL", "b.ndjson"])
def test_json_lines_are_known_by_their_name_in_any_case(tmp_path, name):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps({"text": f"line {i}"}) for i in range(3)) + "\n")
    assert iter_documents(cfg(tmp_path, source=str(path)))[1] == (f"{name}:2", "line 1")


def test_a_json_file_of_json_lines_is_read_as_them_and_a_json_document_as_text(tmp_path):
    lines = tmp_path / "lines.json"
    lines.write_text("\n".join(json.dumps({"text": f"line {i}", "id": i}) for i in range(3)) + "\n")
    assert iter_documents(cfg(tmp_path, source=str(lines)))[1] == ("lines.json:2", "line 1")
    document = tmp_path / "document.json"
    document.write_text(json.dumps({"text": "one", "more": [1, 2]}, indent=1))
    assert iter_documents(cfg(tmp_path, source=str(document))) == [("document.json", document.read_text())]


def qa_corpus(path: Path, n: int = 40) -> Path:
    """JSON lines of a prompt and its answer (a line without an answer among them)."""
    lines = [json.dumps({"prompt": f"Q: what is {i} + {i}?\nA:", "answer": f" {2 * i}\n"}) for i in range(n)]
    path.write_text("\n".join(lines[:3] + [json.dumps({"prompt": "no answer"})] + lines[3:]) + "\n")
    return path


def test_a_prompts_tokens_are_inputs_but_not_targets(tmp_path):
    """With data.jsonl_prompt_field, each document is its prompt then its text; the stream holds the prompt's
    tokens as id + vocabulary size, and a batch has them as inputs whose labels (the next token, when it is one
    of a prompt's) are IGNORE_INDEX. The text and the end of text after it are targets."""
    path = qa_corpus(tmp_path / "qa.jsonl")
    c = cfg(tmp_path, source=str(path), jsonl_field="answer", jsonl_prompt_field="prompt", val_fraction=0.1)
    with pytest.warns(UserWarning, match=r"skipped 1 line\(s\) that are not JSON objects with string field\(s\) "
                                         r"'prompt' and 'answer' \(data.jsonl_prompt_field and data.jsonl_field\)"):
        docs = iter_documents(c)
    assert docs[0] == ("qa.jsonl:1", "Q: what is 0 + 0?\nA: 0\n", len("Q: what is 0 + 0?\nA:"))
    with pytest.warns(UserWarning):
        data = load_data(c)
    train_docs, _ = split_documents(docs, 0.1)
    stream = [i for _, text, k in train_docs for i in [*(b + 257 for b in text[:k].encode()), *text[k:].encode(), 256]]
    assert data.shift == 257 and data.train.tolist() == stream
    [(x, y, _)] = eval_batches(data.train, 16, 2, 1, shift=data.shift)  # the windows at 0 and 16
    ids = [i - 257 * (i >= 257) for i in stream[:33]]
    assert x.tolist() == [ids[:16], ids[16:32]]
    assert y.tolist() == [[IGNORE_INDEX if stream[j] >= 257 else ids[j] for j in range(r + 1, r + 17)] for r in (0, 16)]
    x, y, _ = BatchLoader(data.train, 16, 4, 0, shift=data.shift).batch(0)
    labels = y[y != IGNORE_INDEX].tolist()
    assert ((x >= 0) & (x < 257)).all() and labels and set(labels) <= set(b"0123456789 \n") | {256}


def test_a_prompt_field_is_refused_where_there_are_no_json_lines(tmp_path):
    with pytest.raises(ConfigError, match=r"data.jsonl_prompt_field='prompt' reads prompts from JSON lines, and "
                                          r"data.source='stdlib'"):
        load_config(None, ["data.jsonl_prompt_field=prompt"])
    with pytest.raises(ConfigError, match=r"data.jsonl_prompt_field='text' is data.jsonl_field too"):
        load_config(None, ["data.source=x.jsonl", "data.jsonl_prompt_field=text"])
    write_corpus(tmp_path / "c", 1)
    with pytest.raises(DataError, match=r"doc00.txt is not JSON lines, and data.jsonl_prompt_field='prompt'"):
        iter_documents(cfg(tmp_path, source=str(tmp_path / "c"), jsonl_prompt_field="prompt"))
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "tokens.bin")
    with pytest.raises(DataError, match=r"holds pre-tokenized .bin files, which have no prompts"):
        load_data(cfg(tmp_path, source=str(tmp_path / "tokens.bin"), jsonl_prompt_field="prompt"))


def test_a_lone_surrogate_in_jsonl_becomes_a_replacement_character(tmp_path):
    """Text cut mid-emoji by a scraper: JSON may escape half a surrogate pair, which UTF-8 cannot encode."""
    path = tmp_path / "web.jsonl"
    path.write_text('{"text": "cut \\ud83d"}\n{"text": "whole \\ud83d\\ude42"}\n')
    docs = iter_documents(cfg(tmp_path, source=str(path)))
    assert [t for _, t in docs] == ["cut \ufffd", "whole \U0001f642"]
    assert len(load_data(cfg(tmp_path, source=str(path))).train)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_round_trip(tmp_path, dtype):
    root = tmp_path / "bins"
    root.mkdir()
    tokens = np.random.default_rng(0).integers(0, 257, 1000).astype(dtype)
    tokens[:600].tofile(root / "a.bin")
    tokens[600:].tofile(root / "b.bin")
    (root / "README").write_text("not tokens")
    data = load_data(cfg(tmp_path, source=str(root), format="bin", bin_dtype=dtype, val_fraction=0.1))
    assert data.train.dtype == dtype and len(data.val) == 100
    assert np.array_equal(np.concatenate([data.train, data.val]), tokens)
    single = load_data(cfg(tmp_path, source=str(root / "a.bin"), bin_dtype=dtype, val_fraction=0.1))
    assert np.array_equal(np.concatenate([single.train, single.val]), tokens[:600])
    # a file rewritten in place, its size and modification time kept (cp -p): not read from the cache's copy
    stat = (root / "a.bin").stat()
    np.full(600, 42, dtype=dtype).tofile(root / "a.bin")
    os.utime(root / "a.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    again = load_data(cfg(tmp_path, source=str(root), format="bin", bin_dtype=dtype, val_fraction=0.1))
    assert np.array_equal(np.concatenate([again.train, again.val]), np.concatenate([np.full(600, 42), tokens[600:]]))
    joined = max((tmp_path / "cache").glob("tokens-*.bin"), key=lambda p: p.stat().st_mtime_ns)  # the cache's
    # copy of the files cut short: made again, not read so
    os.truncate(joined, 100)
    whole = load_data(cfg(tmp_path, source=str(root), format="bin", bin_dtype=dtype, val_fraction=0.1))
    assert np.array_equal(np.concatenate([whole.train, whole.val]), np.concatenate([np.full(600, 42), tokens[600:]]))


def test_bin_errors(tmp_path):
    path = tmp_path / "t.bin"
    np.array([1, 2, 300], dtype=np.uint16).tofile(path)
    with pytest.raises(DataError, match="token 300, .*; set data.tokenizer \\(or data.bin_dtype\\) to match, or, if it "
                                        "is not token ids, data.format to read it as text"):
        load_data(cfg(tmp_path, source=str(path)))
    path.write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        load_data(cfg(tmp_path, source=str(path)))
    path.write_bytes(b"abc")
    with pytest.raises(DataError, match="bin_dtype"):
        load_data(cfg(tmp_path, source=str(path)))
    np.array([1, 2, 3], dtype=np.uint16).tofile(path)
    (tmp_path / "notes.txt").write_text(TEXT)
    with pytest.raises(DataError, match=f"mixes .bin token files \\({path}, ...\\) with text files \\("
                                        f"{tmp_path / 'notes.txt'}, ...\\); point data.source at a directory or "
                                        "pattern of one kind \\(data/\\*.txt\\), or set data.format=bin to read only "
                                        "the .bin files"):
        load_data(cfg(tmp_path, source=str(tmp_path)))
    assert load_data(cfg(tmp_path, source=str(tmp_path), format="bin", val_fraction=0.4)).train.tolist() == [1, 2]


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert max(ids) < 256 and tok.decode(ids) == TEXT
    assert tok.decode(ids + [tok.eot] + ids[:3]) == TEXT + "<|endoftext|>" + TEXT[:3]
    assert tok.decode([0xE2, 0x82]) == "\ufffd"


def test_bpe_train_save_load(tmp_path):
    docs = [t for _, t in iter_documents(cfg(tmp_path, source=str(write_corpus(tmp_path / "c"))))]
    tok = BPETokenizer.train(docs, 300)
    assert tok.vocab_size == 300 and tok.name.startswith("bpe-")
    tok.save(tmp_path / "tok.json")
    loaded = BPETokenizer.from_file(tmp_path / "tok.json")
    assert (loaded.name, loaded.eot, loaded.vocab_size) == (tok.name, tok.eot, tok.vocab_size)
    text = TEXT + " <|endoftext|> ünïcödé"
    ids = loaded.encode(text)
    assert loaded.eot not in ids and loaded.decode(ids) == text and ids == tok.encode(text)
    assert len(ids) < len(text.encode())
    with pytest.raises(DataError, match="missing.json"):
        build_tokenizer(cfg(tmp_path, tokenizer=str(tmp_path / "missing.json")), [])
    (tmp_path / "other.json").write_text('{"hello": 1}')
    with pytest.raises(DataError, match="other.json' is JSON but not a tokenizer \\(a model's tokenizer.json, saved by "
                                        "HF tokenizers\\): "):
        build_tokenizer(cfg(tmp_path, tokenizer=str(tmp_path / "other.json")), [])
    (tmp_path / "cut.json").write_text('{"model": ')
    with pytest.raises(DataError, match="cut.json' is not a tokenizers JSON file: "):
        build_tokenizer(cfg(tmp_path, tokenizer=str(tmp_path / "cut.json")), [])


def test_bpe_trains_on_a_long_run_of_non_space_in_words_of_at_most_64_characters():
    """A word's training time grows with the square of its length: a long run is cut for it, so no token is longer
    than a cut; the text still encodes and decodes whole."""
    text = "ab" * 20_000
    tok = BPETokenizer.train([text, TEXT], 400)
    assert max(map(len, tok._tok.get_vocab())) == 64
    assert tok.decode(tok.encode(text)) == text


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def long_text() -> str:
    """About 240,000 characters of real text: three standard library modules and TEXT (accents, an emoji)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "".join((stdlib / name).read_text() for name in ("argparse.py", "typing.py", "textwrap.py")) + TEXT


def trained_tokenizer(kind: str, text: str) -> str:
    """A tokenizer.json trained on text, made as Llama 3's is (its split, byte-level BPE, <|begin_of_text|> before
    a text) or as Llama 2's (sentencepiece-style: "▁" before each word and before a text, <s> before it)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    if kind == "llama3":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        start, end, alphabet = "<|begin_of_text|>", "<|end_of_text|>", pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        start, end, alphabet = "<s>", "</s>", []
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=400, special_tokens=[start, end],
                                                        show_progress=False, initial_alphabet=alphabet))
    tok.post_processor = processors.TemplateProcessing(single=f"{start} $A",
                                                       special_tokens=[(start, tok.token_to_id(start))])
    return tok.to_str()


@pytest.mark.parametrize("kind", ["byte", "bpe", "llama3", "llama2"])
def test_a_long_document_is_tokenized_in_pieces_into_its_tokens_whole(tmp_path, monkeypatch, kind):
    """A document of more than data.PIECE characters is tokenized a piece at a time (a 100 MB file took 20 GB
    whole with BPE), cut where the tokenizer's words end (before a space or after a newline, between non-space
    characters): the stream holds the whole document's tokens. A tokenizer that puts a space before each text
    (Llama 2's) would tokenize the pieces otherwise: its documents are tokenized whole."""
    text = long_text()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "long.txt").write_text(text)
    tokenizer = kind
    if kind.startswith("llama"):
        tokenizer = str(tmp_path / "tok.json")
        Path(tokenizer).write_text(trained_tokenizer(kind, text[:100_000]))
    cls, lengths = ByteTokenizer if kind == "byte" else BPETokenizer, []
    real = cls.encode_batch
    monkeypatch.setattr(cls, "encode_batch", lambda self, texts: lengths.extend(map(len, texts)) or real(self, texts))
    d = load_data(cfg(tmp_path, source=str(tmp_path / "c"), tokenizer=tokenizer, bpe_vocab_size=400))
    assert np.array_equal(np.concatenate([d.train, d.val]), [*d.tokenizer.encode(text), d.tokenizer.eot])
    assert sum(lengths) == len(text)
    if kind == "llama2":
        assert d.tokenizer.cut is None and lengths == [len(text)]
    else:
        assert len(lengths) >= 3 and max(lengths) <= data_module.PIECE + 100


@pytest.mark.parametrize("added, text", [
    (dict(content="<tool>", rstrip=True), "x" * 65530 + "<tool> y z"),  # it takes the space after it
    (dict(content="hello world"), "x" * 65531 + " hello world end")])  # one token across a place to cut
def test_a_cut_is_made_only_where_the_tokens_around_it_are_the_same_as_whole(tmp_path, added, text):
    """A tokenizer's added tokens (not special) are matched before its words are split, which its probe does not
    see: each cut is checked in the text around it, and one that would change the tokens is not taken."""
    from tokenizers import AddedToken, Tokenizer
    tok = Tokenizer.from_str(trained_tokenizer("llama3", long_text()[:50_000]))
    tok.add_tokens([AddedToken(**added, special=False)])
    (tmp_path / "tok.json").write_text(tok.to_str())
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "long.txt").write_text(text)
    d = load_data(cfg(tmp_path, source=str(tmp_path / "c"), tokenizer=str(tmp_path / "tok.json"), val_fraction=0))
    assert d.tokenizer.cut is not None and len(d.tokenizer.pieces(text)) == 2
    assert np.array_equal(d.train, [*d.tokenizer.encode(text), d.tokenizer.eot])


def test_a_tokenizer_that_cannot_encode_the_probe_tokenizes_documents_whole(tmp_path):
    """A word-level tokenizer without an unknown token encodes only its words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<|endoftext|>": 2}))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    (tmp_path / "tok.json").write_text(tok.to_str())
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "ab.txt").write_text("a b a b a\n" * 10)
    d = load_data(cfg(tmp_path, source=str(tmp_path / "c"), tokenizer=str(tmp_path / "tok.json"), val_fraction=0))
    assert d.tokenizer.cut is None and list(d.train) == [0, 1, 0, 1, 0] * 10 + [2]


def test_bpe_trained_on_a_long_document_in_pieces_is_the_one_trained_on_it_whole(monkeypatch):
    text = long_text()
    assert len(data_module.cut_text(text, data_module.WORD_CUT)) >= 3
    pieces = BPETokenizer.train([text], 400).to_json()
    monkeypatch.setattr(data_module, "PIECE", len(text))
    assert BPETokenizer.train([text], 400).to_json() == pieces


def test_load_data_bpe_and_cache_reuse(tmp_path, monkeypatch):
    c = cfg(tmp_path, source=str(write_corpus(tmp_path / "c")), tokenizer="bpe", bpe_vocab_size=300,
            val_fraction=0.2)
    data = load_data(c)
    assert isinstance(data.tokenizer, BPETokenizer) and data.train.dtype == np.uint16
    assert len(data.train) and len(data.val) and data.train[-1] == data.tokenizer.eot
    files = sorted((tmp_path / "cache").glob("*.bin")) + sorted((tmp_path / "cache").glob("bpe-*.json"))
    assert len(files) == 3
    stamps = [f.stat().st_mtime_ns for f in files]
    monkeypatch.setattr(corpus_module, "_read", lambda *a, **k: pytest.fail("the corpus was read again"))
    again = load_data(c)
    assert [f.stat().st_mtime_ns for f in files] == stamps
    assert np.array_equal(again.train, data.train) and again.tokenizer.name == data.tokenizer.name
    bpe = files[-1]
    bpe.write_text(bpe.read_text()[:100])  # damaged: trained again, under its name
    monkeypatch.undo()
    assert load_data(c).tokenizer.encode("# document 1") == data.tokenizer.encode("# document 1")
    text = data.tokenizer.decode(np.asarray(data.train))
    assert "# document" in text and "<|endoftext|>" in text


@pytest.mark.parametrize("val_fraction", [0.1, 0.99])
def test_single_file_is_split_by_tokens(tmp_path, val_fraction):
    """Whatever its name hashes to (at 0.99 nearly every name hashes below it), one document is split by tokens."""
    path = tmp_path / "one.txt"
    path.write_bytes(b"\xef\xbb\xbf" + (TEXT * 20).encode())  # with a byte-order mark, dropped
    assert split_documents([("one.txt", "x")], val_fraction) == ([("one.txt", "x")], [])
    data = load_data(cfg(tmp_path, source=str(path), val_fraction=val_fraction))
    total = len(TEXT.encode()) * 20 + 1
    assert len(data.val) == int(total * val_fraction) and len(data.train) + len(data.val) == total
    assert data.val[-1] == 256 and data.train[0] == TEXT.encode()[0]


def test_a_val_fraction_of_0_trains_on_every_token(tmp_path):
    """Text files, one file, token files: the val split is empty (read again from the cache too), nothing is lost."""
    root = write_corpus(tmp_path / "corpus")
    held = load_data(cfg(tmp_path, source=str(root), val_fraction=0.1))
    for _ in range(2):
        data = load_data(cfg(tmp_path, source=str(root), val_fraction=0))
        assert len(data.val) == 0 and len(data.train) == len(held.train) + len(held.val)
    one = tmp_path / "one.txt"
    one.write_text(TEXT)
    assert len(load_data(cfg(tmp_path, source=str(one), val_fraction=0)).val) == 0
    tokens = np.arange(300, dtype=np.uint16) % 257
    tokens.tofile(tmp_path / "t.bin")
    data = load_data(cfg(tmp_path, source=str(tmp_path / "t.bin"), val_fraction=0))
    assert len(data.val) == 0 and np.array_equal(data.train, tokens)
    BatchLoader(data.train, 8, 4, 0).batch(0)


def test_max_bytes_reads_a_jsonl_file_only_as_far_as_it_needs(tmp_path):
    """A JSONL file is read a line at a time until its documents hold data.max_bytes of text: here the bytes after
    3 MB are not UTF-8."""
    path = tmp_path / "big.jsonl"
    lines = [json.dumps({"meta": "m" * 3000, "text": f"{i:03d}" + "x" * 97}) + "\n" for i in range(1000)]
    path.write_bytes("".join(lines).encode() + b"\xff" * 1_000_000)
    assert iter_documents(cfg(tmp_path, source=str(path), max_bytes=150)) == [
        ("big.jsonl:1", "000" + "x" * 97), ("big.jsonl:2", "001" + "x" * 47)]
    docs = iter_documents(cfg(tmp_path, source=str(path), max_bytes=40_000))  # more than the first 1 MB holds
    assert len(docs) == 400 and docs[-1] == ("big.jsonl:400", "399" + "x" * 97)


def test_max_bytes_reads_a_file_only_as_far_as_it_needs(tmp_path):
    """Bytes past data.max_bytes are not read: here they are not even UTF-8, and a character the limit cuts is
    left out."""
    path = tmp_path / "big.txt"
    path.write_bytes("ab\u00e9".encode() + b"\xff" * 100)
    assert iter_documents(cfg(tmp_path, source=str(path), max_bytes=3)) == [("big.txt", "ab")]
    with pytest.warns(UserWarning, match="not UTF-8"):
        with pytest.raises(DataError, match="no non-empty UTF-8 documents"):
            iter_documents(cfg(tmp_path, source=str(path)))


def test_linked_directories_are_followed_once(tmp_path):
    root = write_corpus(tmp_path / "corpus", 2)
    write_corpus(tmp_path / "shard", 1)
    (root / "linked").symlink_to(tmp_path / "shard")
    (root / "loop").symlink_to(root)  # a cycle is not followed around
    (root / "twin").symlink_to(tmp_path / "shard")  # two links to one directory: read once
    (root / "latest.txt").symlink_to(root / "doc01.txt")  # a file by two names: read once, by its first
    ids = [d for d, _ in iter_documents(cfg(tmp_path, source=str(root)))]
    assert ids == ["doc00.txt", "doc01.txt", "linked/doc00.txt"]


def test_a_pattern_reads_the_files_it_matches(tmp_path, monkeypatch):
    """data.source as a glob: `*` within a name, `**` any depth; hidden files and sixfold's own skipped as in a
    directory; ids relative to the directory before the first wildcard; one that matches nothing is refused."""
    root = write_corpus(tmp_path / "corpus", 2)
    write_corpus(root / "sub" / "deep", 1)
    (root / "README.md").write_text("not data")
    (root / "sub" / ".hidden.txt").write_text("secret")
    (root / "sub" / "a.jsonl").write_text(json.dumps({"text": "a line"}) + "\n")

    def ids(source: str) -> list[str]:
        return [d for d, _ in iter_documents(cfg(tmp_path, source=source))]

    assert ids(str(root / "*.txt")) == ["doc00.txt", "doc01.txt"]
    assert ids(str(root / "**" / "*.txt")) == ["doc00.txt", "doc01.txt", "sub/deep/doc00.txt"]
    assert ids(str(root / "s?b" / "*.jsonl")) == ["sub/a.jsonl:1"]
    monkeypatch.chdir(root)
    assert ids("**/doc0[1-9].txt") == ["doc01.txt"]
    assert ids("sub/**") == ["a.jsonl:1", "deep/doc00.txt"]
    (root / "other").mkdir()
    (root / "other" / "link").symlink_to(root / "sub" / "deep")  # a directory reached twice: by its first path
    assert ids("*/link/*.txt") == ["other/link/doc00.txt"]
    assert ids("**/*.txt") == ["doc00.txt", "doc01.txt", "other/link/doc00.txt"]
    top = Path("/", root.parts[1][:-1] + "?", *root.parts[2:], "*.txt")  # a wildcard near / reads only its part
    assert ids(str(top)) == [f"{root.relative_to('/').as_posix()}/doc0{i}.txt" for i in (0, 1)]
    with pytest.raises(DataError, match=r"data\.source='\*\.csv' matches no files under " + str(root)):
        iter_documents(cfg(tmp_path, source="*.csv"))


def test_a_tokenizer_with_gaps_in_its_ids_counts_up_to_its_largest(tmp_path):
    docs = [t for _, t in iter_documents(cfg(tmp_path, source=str(write_corpus(tmp_path / "c"))))]
    BPETokenizer.train(docs, 300).save(tmp_path / "tok.json")
    spec = json.loads((tmp_path / "tok.json").read_text())
    for t in spec["added_tokens"]:
        if t["content"] == "<|endoftext|>":
            t["id"] = 70000  # special tokens above a reserved range, as some tokenizers have them
    spec["model"]["vocab"]["<|endoftext|>"] = 70000
    (tmp_path / "gaps.json").write_text(json.dumps(spec))
    data = load_data(cfg(tmp_path, source=str(tmp_path / "c"), tokenizer=str(tmp_path / "gaps.json")))
    assert data.tokenizer.vocab_size == 70001 and data.train.dtype == np.uint32 and data.val[-1] == 70000


def test_load_data_stdlib_bytes(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = load_data(cfg(tmp_path, max_bytes=200_000))
    assert isinstance(data.tokenizer, ByteTokenizer) and data.train.dtype == np.uint16
    assert len(data.train) and len(data.val) and len(data.train) + len(data.val) > 200_000
    assert (np.asarray(data.train) == 256).any() and data.val[-1] == 256


def test_concurrent_load_data(tmp_path):
    root = write_corpus(tmp_path / "c")
    code = ("import sys; from sixfold.config import DataConfig; from sixfold.data import load_data; "
            f"d = load_data(DataConfig(source={str(root)!r}, tokenizer='bpe', bpe_vocab_size=300, "
            f"cache_dir={str(tmp_path / 'cache')!r})); print(d.tokenizer.name, int(d.train.sum()))")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs) and len(set(outs)) == 1
    assert len(list((tmp_path / "cache").glob("bpe-*.json"))) == 1
    assert not list((tmp_path / "cache").glob(".*tmp*"))


def test_a_build_stopped_part_way_leaves_no_files(tmp_path, monkeypatch):
    """Stopped while it writes the val stream (here Ctrl-C; a lost peer stops it the same way), the cache keeps no
    half-written file, and the next run builds it whole."""
    c = cfg(tmp_path, source=str(write_corpus(tmp_path / "c")), val_fraction=0.2)
    real, calls = ByteTokenizer.encode_batch, []

    def stopped_second_time(self, texts):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, texts)

    monkeypatch.setattr(ByteTokenizer, "encode_batch", stopped_second_time)
    with pytest.raises(KeyboardInterrupt):
        load_data(c)
    assert not [f.name for f in (tmp_path / "cache").iterdir() if not f.name.endswith(".lock")]
    monkeypatch.setattr(ByteTokenizer, "encode_batch", real)
    data = load_data(c)
    assert len(data.train) and len(data.val)


def test_cached_corpus_is_opened_without_reading_its_text(tmp_path, monkeypatch):
    root = write_corpus(tmp_path / "c")
    c = cfg(tmp_path, source=str(root), tokenizer="bpe", bpe_vocab_size=300)
    first = load_data(c)
    read = []
    real = corpus_module._read
    monkeypatch.setattr(corpus_module, "_read", lambda *a, **k: read.append(1) or real(*a, **k))
    again = load_data(c)
    assert not read and np.array_equal(again.train, first.train) and np.array_equal(again.val, first.val)
    assert again.tokenizer.name == first.tokenizer.name
    doc = sorted(root.iterdir())[0]
    doc.write_text(doc.read_text() + "more text\n")  # a changed file is read again
    changed = load_data(c)
    assert read and len(changed.train) + len(changed.val) > len(first.train) + len(first.val)
    read.clear()
    st = doc.stat()
    doc.write_text(doc.read_text().upper())  # same size, modification time put back (as cp -p does)
    os.utime(doc, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert not np.array_equal(load_data(c).train, changed.train) and read
    changed = load_data(c)
    for val in (tmp_path / "cache").glob("tokens-*.val.bin"):  # a stream gone: rebuilt
        val.unlink()
    assert np.array_equal(load_data(c).val, changed.val)
    for index in (tmp_path / "cache").glob("index-*.json"):  # a corrupt index: the text is read again
        index.write_text("{")
    read.clear()
    assert np.array_equal(load_data(c).train, changed.train) and read


def tokens(n=1000):
    return np.random.default_rng(1).integers(0, 257, n).astype(np.uint16)


def test_batches_shard_across_ranks():
    t = tokens()
    whole = BatchLoader(t, 16, 8, seed=3)
    for step in (0, 1, 7):
        x, y, _ = whole.batch(step)
        parts = [BatchLoader(t, 16, 8, seed=3, batch_index=r, batch_count=4).batch(step) for r in range(4)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
        assert x.shape == (8, 16) and x.dtype == torch.int64
        windows = {tuple(t[s:s + 17]) for s in range(0, 1000 - 16, 16)}
        assert all(tuple(a) + (b[-1],) in windows for a, b in zip(x.tolist(), y.tolist()))
        assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(whole.batch(0)[0], whole.batch(1)[0])
    assert torch.equal(BatchLoader(t, 16, 8, seed=3).batch(5)[0], whole.batch(5)[0])
    assert not torch.equal(BatchLoader(t, 16, 8, seed=4).batch(5)[0], whole.batch(5)[0])


def test_epochs_cover_every_window():
    t = np.arange(10 * 4 + 1, dtype=np.uint16)  # 10 windows of 4, each starting at a distinct token
    loader = BatchLoader(t, 4, 4, seed=0)
    firsts = torch.cat([loader.batch(s)[0][:, 0] for s in range(5)]).tolist()  # 20 samples = 2 epochs
    assert sorted(firsts[:10]) == sorted(firsts[10:]) == list(range(0, 40, 4))
    assert firsts[:10] != firsts[10:]
    small = BatchLoader(np.arange(9, dtype=np.uint16), 4, 8, seed=0)  # 2 windows, batch of 8 wraps
    assert small.batch(0)[0].shape == (8, 4)
    with pytest.raises(DataError, match="seq_len"):
        BatchLoader(np.arange(4, dtype=np.uint16), 4, 8, seed=0)


def test_micro_batches_and_state():
    loader = BatchLoader(tokens(), 16, 8, seed=3, batch_index=1, batch_count=2)
    whole = BatchLoader(tokens(), 16, 8, seed=3).micro_batches(2, 2)  # micro-batch i: global rows 4i .. 4i+3
    micro = loader.micro_batches(2, 2)  # rank 1 of 2: the second half of each
    assert len(micro) == 2 and all(torch.equal(m[k], w[k][2:]) for m, w in zip(micro, whole) for k in (0, 1))
    assert torch.equal(torch.cat([w[0] for w in whole]), BatchLoader(tokens(), 16, 8, seed=3).batch(2)[0])
    with pytest.raises(DataError, match="micro_batches"):
        loader.micro_batches(2, 3)
    loader.next_step = 11
    state = loader.state_dict()
    assert state == {"seed": 3, "seq_len": 16, "global_batch": 8, "next_step": 11}
    fresh = BatchLoader(tokens(), 16, 8, seed=3)
    assert fresh.load_state_dict(state) == {} and fresh.next_step == 11
    for key, value in (("seed", 4), ("seq_len", 32), ("global_batch", 16)):  # its own order from the saved step
        assert fresh.load_state_dict({**state, key: value, "next_step": 7}) == {key: (value, state[key])}
        assert fresh.next_step == 7


def test_eval_batches_are_fixed_and_sharded():
    t = tokens()
    whole = eval_batches(t, 16, 4, 3, 0, 1)
    assert len(whole) == 3 and torch.equal(whole[0][0][0], torch.from_numpy(t[:16].astype(np.int64)))
    halves = [eval_batches(t, 16, 4, 3, r, 2) for r in range(2)]
    for i in range(3):
        assert torch.equal(torch.cat([halves[0][i][0], halves[1][i][0]]), whole[i][0])
    with pytest.raises(DataError, match="val_fraction"):
        eval_batches(t[:10], 16, 4, 1, 0, 1)


@pytest.mark.parametrize("damage", ["cut short", "overwritten", "overwritten, modification time restored"])
def test_a_damaged_token_cache_is_tokenized_again(tmp_path, damage):
    c = cfg(tmp_path, source=str(write_corpus(tmp_path / "c")))
    data = load_data(c)
    first = np.array(data.train), np.array(data.val)  # copies: the damage below is to the mapped file
    del data
    (train,) = (tmp_path / "cache").glob("tokens-*.train.bin")
    st = train.stat()
    size = st.st_size
    if damage == "cut short":
        os.truncate(train, size // 2)
    else:
        train.write_bytes(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    if damage.endswith("restored"):  # as a copy that keeps times would: only the change time tells
        os.utime(train, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.warns(UserWarning, match="changed since"):
        again = load_data(c)
    assert np.array_equal(again.train, first[0]) and np.array_equal(again.val, first[1])
    del again
    for index in (tmp_path / "cache").glob("index-*.json"):  # the index gone too: the streams checked all the same
        index.unlink()
    train.write_bytes(b"\0" * size)
    assert np.array_equal(load_data(c).train, first[0])


def test_an_unreadable_corpus_file_names_itself(tmp_path):
    """A file whose read fails (here one of /proc's, which refuses reads even to root) is a DataError naming it."""
    root = write_corpus(tmp_path / "c", 1)
    bad = root / "bad.txt"
    bad.symlink_to("/proc/self/clear_refs")
    for source in (root, bad):
        with pytest.raises(DataError, match=r"(bad\.txt|clear_refs) cannot be read \(Invalid argument\); fix its "
                                            r"permissions or remove it from data\.source"):
            load_data(cfg(tmp_path, source=str(source)))


def test_a_tokenizer_file_that_cannot_be_read_or_is_a_directory_is_refused_by_name(tmp_path):
    """(/proc's mem refuses a read at its start even to root, as a file without read permission refuses others.)"""
    (tmp_path / "mem.json").symlink_to("/proc/self/mem")
    with pytest.raises(DataError, match=r"mem\.json' cannot be read \(Input/output error\); fix its permissions"):
        build_tokenizer(cfg(tmp_path, tokenizer=str(tmp_path / "mem.json")), [])
    (tmp_path / "model.json").mkdir()
    with pytest.raises(DataError, match=r"model\.json' is not a file; give a tokenizer\.json"):
        build_tokenizer(cfg(tmp_path, tokenizer=str(tmp_path / "model.json")), [])


def test_an_unreadable_bin_file_names_itself(tmp_path, monkeypatch):
    path = tmp_path / "t.bin"
    np.arange(10, dtype=np.uint16).tofile(path)

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(np, "memmap", refused)  # as a file without read permission (root reads those all the same)
    with pytest.raises(DataError, match=r"t\.bin cannot be read \(Permission denied\); fix its permissions"):
        load_data(cfg(tmp_path, source=str(path)))


def test_uint32_token_ids_read_as_uint16_are_refused(tmp_path):
    ids = np.random.default_rng(0).integers(1, 257, 1000)
    path = tmp_path / "t.bin"
    ids.astype(np.uint32).tofile(path)  # little-endian: every other uint16 is a high half, 0
    with pytest.raises(DataError, match=r"t\.bin looks like uint32 token ids \(every other uint16 in it is 0\); "
                                        r"set data\.bin_dtype=uint32"):
        load_data(cfg(tmp_path, source=str(path)))
    data = load_data(cfg(tmp_path, source=str(path), bin_dtype="uint32"))
    assert np.array_equal(np.concatenate([data.train, data.val]), ids)
    genuine = ids.astype(np.uint16)
    genuine[1::2][:-1] = 0  # zeros at odd positions, but not all of them
    genuine.tofile(path)
    data = load_data(cfg(tmp_path, source=str(path)))
    assert np.array_equal(np.concatenate([data.train, data.val]), genuine)


@pytest.mark.parametrize("fmt", ["auto", "text"])
@pytest.mark.parametrize("cache", [".", "cache"])
def test_a_token_cache_inside_the_corpus_is_not_read_as_corpus(tmp_path, monkeypatch, cache, fmt):
    """data.cache_dir the same directory as data.source, or inside it: the cache's own files are not corpus, and
    the corpus (and so its cache key) is the same on the second load as on the first."""
    root = write_corpus(tmp_path / "c", 3)
    c = DataConfig(source=str(root), cache_dir=str(root / cache), format=fmt, tokenizer="bpe", bpe_vocab_size=300)
    first = load_data(c)
    monkeypatch.setattr(corpus_module, "_read", lambda *a, **k: pytest.fail("the corpus was read again"))
    with pytest.warns(UserWarning, match=r"skipped \d+ of sixfold's own .*tokens-"):
        again = load_data(c)
    monkeypatch.undo()
    assert np.array_equal(again.train, first.train) and np.array_equal(again.val, first.val)
    with pytest.warns(UserWarning, match="sixfold's own"):
        assert [d for d, _ in iter_documents(c)] == ["doc00.txt", "doc01.txt", "doc02.txt"]


def test_run_and_checkpoint_directories_inside_the_corpus_are_skipped(tmp_path):
    root = write_corpus(tmp_path / "c", 2)
    run = root / "runs" / "a"
    (run / "checkpoints" / "step_0000002").mkdir(parents=True)
    (run / "config.yaml").write_text(RUN_CONFIG_HEAD + "model: {}\n")
    (run / "comm_ledger.json").write_text("{}")
    old = root / "runs" / "old"  # a run from before config.yaml's first line said so
    old.mkdir()
    (old / "config.yaml").write_text("model: {}\n")
    (old / "metrics.jsonl").write_text("{}\n")
    (root / "runs" / "b" / "checkpoints").mkdir(parents=True)  # its config.yaml gone
    (root / "runs" / "b" / "checkpoints" / "latest").write_text("step_0000001")
    step = root / "copied" / "step_0000001"  # a checkpoint copied on its own
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    (step / "meta.sha256").write_text("0" * 64)
    project = root / "project"  # corpus files that share names with a run's
    project.mkdir()
    for name in ("config.yaml", "meta.json", "comm_ledger.json"):
        (project / name).write_text(f"{name}\n")
    with pytest.warns(UserWarning, match=r"skipped 4 of sixfold's own .*: copied/step_0000001, runs/a, runs/b, "
                                         r"runs/old$"):
        docs = iter_documents(cfg(tmp_path, source=str(root)))
    assert [d for d, _ in docs] == ["doc00.txt", "doc01.txt", "project/comm_ledger.json", "project/config.yaml",
                                    "project/meta.json"]
    (run / "checkpoints" / "latest").write_text("step_0000002")
    for directory in (run, run / "checkpoints", step):  # given as the source itself: refused, not read as text
        with pytest.raises(DataError, match=f"{directory} is a sixfold run directory or checkpoint, whose files are "
                                            f"no corpus; point data.source at the directory of the text files"):
            iter_documents(cfg(tmp_path, source=str(directory)))
    same = load_config(None, [f"data.source={root}", f"log.run_dir={root}/."])  # a saved config so is read
    with pytest.raises(ConfigError, match="data.source and log.run_dir are both .* set log.run_dir to another"):
        make_run_dir(same)  # and refused before training


@pytest.mark.parametrize("kind", ["text", "jsonl"])
def test_a_corpus_is_tokenized_without_holding_its_documents(tmp_path, monkeypatch, kind):
    """Reading a corpus holds one file's text and one chunk of pieces at a time, not the whole (tracemalloc's peak
    while load_data runs, against 8 MB of documents in 40 files); the streams are those of the corpus read whole."""
    import tracemalloc
    root = tmp_path / "c"
    root.mkdir()
    body = TEXT * 2800  # about 200 KB a document
    for i in range(40):
        if kind == "text":
            (root / f"doc{i:02d}.txt").write_text(f"# {i}\n{body}")
        else:
            (root / f"part{i:02d}.jsonl").write_text(json.dumps({"text": f"# {i}\n{body}"}) + "\n")
    monkeypatch.setattr(data_module, "CHUNK", 1 << 16)
    tracemalloc.start()
    try:
        data = load_data(cfg(tmp_path, source=str(root), val_fraction=0.1))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 6_000_000, f"peak {peak:,} bytes"  # (the whole held: over 90 MB)
    docs = iter_documents(cfg(tmp_path, source=str(root)))
    train, val = split_documents(docs, 0.1)
    tok = ByteTokenizer()
    expected = [np.array([*tok.start, *tok.encode(text), tok.eot]) for part in (train, val) for _, text in part]
    got = np.concatenate([np.asarray(data.train), np.asarray(data.val)])
    assert len(val) and np.array_equal(got, np.concatenate(expected))


def test_a_corpus_changed_while_it_is_read_is_refused_and_leaves_no_tokens(tmp_path, monkeypatch):
    root = write_corpus(tmp_path / "c")
    real = data_module._write_cache

    def edit_then_write(*args):  # between the first pass (counting) and the one that tokenizes
        (root / "doc03.txt").write_text("something else entirely")
        return real(*args)
    monkeypatch.setattr(data_module, "_write_cache", edit_then_write)
    with pytest.raises(DataError, match="changed while it was read .*leave its files as they are"):
        load_data(cfg(tmp_path, source=str(root)))
    assert not list((tmp_path / "cache").glob("tokens-*.bin"))
    monkeypatch.setattr(data_module, "_write_cache", real)
    assert len(load_data(cfg(tmp_path, source=str(root))).train)


def test_a_corpus_file_removed_while_it_is_read_is_named_and_leaves_no_tokens(tmp_path, monkeypatch):
    root = write_corpus(tmp_path / "c")
    real = data_module._write_cache

    def remove_then_write(*args):  # between the first pass (counting) and the one that tokenizes
        (root / "doc03.txt").unlink()
        return real(*args)
    monkeypatch.setattr(data_module, "_write_cache", remove_then_write)
    with pytest.raises(DataError, match="doc03.txt is gone since data.source was listed; leave its files as they are"):
        load_data(cfg(tmp_path, source=str(root)))
    assert not list((tmp_path / "cache").glob("tokens-*.bin"))
    kind, found, files = corpus_module._corpus(cfg(tmp_path, source=str(root)))
    (root / "doc04.txt").unlink()  # between the listing and the look in the cache: named, not a traceback
    with pytest.raises(DataError, match="doc04.txt is gone since data.source was listed"):
        data_module._index_path(cfg(tmp_path, source=str(root)), found, files)


@pytest.mark.parametrize("val_fraction", [0.0, 0.2, 0.6, 0.999])
def test_the_first_pass_hashes_the_train_split_as_it_is_drawn(tmp_path, val_fraction):
    """The bpe tokenizer's cache key, the train documents' hash, comes from the first pass (no pass of its own)
    where the split is as drawn; where one draw is given back to train (all fell to val), it is read again."""
    from sixfold.corpus import Corpus, _corpus, _docs_hash
    c = cfg(tmp_path, source=str(write_corpus(tmp_path / "c", 30)), val_fraction=val_fraction)
    corpus = Corpus(c, *_corpus(c)[1:])
    train = list(corpus.part(False))
    assert len(train) == len(corpus.part(False)) and len(train) + len(corpus.part(True)) == 30
    assert corpus.train_digest == (_docs_hash(train) if val_fraction < 0.99 else None)


# ---- links, caches and limits of odd corpora ----

def test_a_jsonl_line_nested_too_deeply_is_a_bad_line_not_a_traceback(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"text": "one"}\n' + "[" * 100_000 + '\n{"text": "two"}\n')
    with pytest.warns(UserWarning, match="skipped 1 line"):
        assert [d[1] for d in iter_documents(cfg(tmp_path, source=str(path)))] == ["one", "two"]
    (tmp_path / "deep.json").write_text("[" * 100_000 + "\n" + "[" * 100_000 + "\n")
    iter_documents(cfg(tmp_path, source=str(tmp_path / "deep.json")))  # not JSON lines: text


def test_a_loop_of_links_as_data_source_is_refused_by_name(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(DataError, match="does not exist"):
        load_data(cfg(tmp_path, source=str(tmp_path / "a")))


def test_a_cache_that_cannot_be_written_is_refused_naming_data_cache_dir(tmp_path, monkeypatch):
    write_corpus(tmp_path / "c")

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(data_module, "_write_cache", full)
    with pytest.raises(DataError, match="cannot write the cache in .*data.cache_dir"):
        load_data(cfg(tmp_path, source=str(tmp_path / "c")))


def test_a_concatenated_bin_cache_overwritten_in_place_is_made_again(tmp_path):
    root = tmp_path / "bins"
    root.mkdir()
    tokens = np.arange(2000, dtype=np.uint16) % 256
    tokens[:1000].tofile(root / "a.bin")
    tokens[1000:].tofile(root / "b.bin")
    c = cfg(tmp_path, source=str(root), val_fraction=0)
    first = np.asarray(load_data(c).train).copy()
    cached = next((tmp_path / "cache").glob("tokens-*.bin"))
    cached.write_bytes(b"\0" * cached.stat().st_size)  # same size, other tokens
    assert np.array_equal(np.asarray(load_data(c).train), first)


def test_max_bytes_keeps_only_whole_prompt_and_answer_documents(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"p": f"question {i}? ", "a": f"answer {i}."}) + "\n" for i in range(10)))
    docs = iter_documents(cfg(tmp_path, source=str(path), jsonl_prompt_field="p", jsonl_field="a", max_bytes=60))
    assert [d[1] for d in docs] == ["question 0? answer 0.", "question 1? answer 1."]  # the third, cut, left out
    with pytest.raises(DataError, match="raise data.max_bytes"):
        iter_documents(cfg(tmp_path, source=str(path), jsonl_prompt_field="p", jsonl_field="a", max_bytes=10))


def test_a_token_cache_left_in_the_corpus_by_an_earlier_cache_dir_is_not_read_as_corpus(tmp_path):
    root = write_corpus(tmp_path / "c")
    load_data(DataConfig(source=str(root), cache_dir=str(root / "cache")))
    with pytest.warns(UserWarning, match="sixfold's own"):
        data = load_data(cfg(tmp_path, source=str(root)))  # another data.cache_dir now
    assert data.read.startswith("12 documents from 12 of 12 files")


def test_a_file_hard_linked_under_two_names_is_read_once(tmp_path):
    root = write_corpus(tmp_path / "c", n=40)
    (root / "copy").mkdir()
    for p in sorted(root.glob("*.txt")):
        os.link(p, root / "copy" / p.name)
    for source in (root, root / "**" / "*.txt"):
        assert len(iter_documents(cfg(tmp_path, source=str(source)))) == 40


def test_a_file_whose_name_is_not_utf8_is_read(tmp_path):
    """A name from an old archive (Latin-1 bytes), as os.walk gives it (surrogateescape): its document is read, drawn
    and hashed by the name's bytes (was a UnicodeEncodeError naming no file)."""
    root = write_corpus(tmp_path / "c", 3)
    Path(os.fsdecode(os.fsencode(root) + b"/caf\xe9.txt")).write_text(TEXT)
    docs = iter_documents(cfg(tmp_path, source=str(root)))
    assert [d[0] for d in docs] == ["caf\udce9.txt", "doc00.txt", "doc01.txt", "doc02.txt"] and docs[0][1] == TEXT
    data = load_data(cfg(tmp_path, source=str(root)))
    assert data.read.startswith("4 documents from 4 of 4 files")
    assert load_data(cfg(tmp_path, source=str(root))).read == data.read  # from the cache's index


def test_a_wrong_data_tokenizer_is_refused_before_the_corpus_is_read(tmp_path, monkeypatch):
    root = write_corpus(tmp_path / "c", 3)

    def unread(*args):
        raise AssertionError("the corpus was read")
    monkeypatch.setattr(data_module, "Corpus", unread)
    for tokenizer, said in (("bytes", "choose byte, bpe or a path"), (str(tmp_path / "no.json"), "does not exist")):
        with pytest.raises(DataError, match=f"data.tokenizer='{tokenizer}'.*{said}"):
            load_data(cfg(tmp_path, source=str(root), tokenizer=tokenizer))


def test_a_file_under_two_names_is_named_alike_by_a_directory_and_a_pattern(tmp_path):
    """By its first name in order (a/z.txt), not by the one a pattern reaches first (b.txt, at no depth of **): the
    id draws the document's split and places it in the stream."""
    root = tmp_path / "c"
    (root / "a").mkdir(parents=True)
    (root / "b.txt").write_text(TEXT)
    os.link(root / "b.txt", root / "a" / "z.txt")
    (root / "c.txt").write_text(TEXT * 2)
    for source in (root, root / "**" / "*.txt", root / "**"):
        assert [i for i, _ in iter_documents(cfg(tmp_path, source=str(source)))] == ["a/z.txt", "c.txt"], source


def test_max_bytes_limits_token_files_too(tmp_path):
    root = tmp_path / "bins"
    root.mkdir()
    (np.arange(3000, dtype=np.uint16) % 256).tofile(root / "a.bin")
    data = load_data(cfg(tmp_path, source=str(root / "a.bin"), max_bytes=1000, val_fraction=0.01))
    assert len(data.train) + len(data.val) == 500 and "data.max_bytes=1,000 reached" in data.read
    for max_bytes in (1, 3):  # fewer than 2 tokens: the limit named, not the corpus
        with pytest.raises(DataError, match=f"data.max_bytes={max_bytes} holds {max_bytes // 2} uint16 token\\(s\\) "
                                            f"of .*a.bin; raise data.max_bytes"):
            load_data(cfg(tmp_path, source=str(root / "a.bin"), max_bytes=max_bytes))


def test_a_damaged_copy_of_a_checkpoints_tokenizer_in_the_cache_is_written_again(tmp_path):
    """A resume of a bpe run reads its checkpoint's tokenizer from a copy in data.cache_dir: one cut short since is
    written again, not refused at every resume under a data.tokenizer the user did not set."""
    text = BPETokenizer.train([TEXT * 20], 300).to_json().encode()
    path = Path(with_tokenizer(cfg(tmp_path), text).tokenizer)
    path.write_bytes(text[:100])
    assert with_tokenizer(cfg(tmp_path), text).tokenizer == str(path) and path.read_bytes() == text
    assert BPETokenizer.from_file(path).name == BPETokenizer.from_json(text.decode(), "the checkpoint").name


def test_a_checkpoints_tokenizer_already_in_a_cache_that_cannot_be_written_is_read_from_it(tmp_path):
    """A bpe run resumes from a cache it cannot write (a read-only mount, shared), as a fresh run does, where the
    checkpoint's tokenizer is there already: no lock is taken to read it."""
    text = BPETokenizer.train([TEXT * 20], 300).to_json().encode()
    path = Path(with_tokenizer(cfg(tmp_path), text).tokenizer)
    lock = path.with_name(path.name + ".lock")
    lock.unlink()
    lock.mkdir()  # no lock can be taken there
    assert with_tokenizer(cfg(tmp_path), text).tokenizer == str(path)
    path.write_bytes(text[:100])  # damaged: written again, which needs the lock
    with pytest.raises(DataError, match="cannot write the cache in .*; set data.cache_dir"):
        with_tokenizer(cfg(tmp_path), text)
