"""Tokenizers, cached token streams and deterministic batches.

A corpus (sixfold.corpus: the Python standard library, a text file or directory, JSON lines) is tokenized once,
its documents streamed from the files, and cached in data.cache_dir as flat train and val token streams with an
end-of-text token after each document; pre-tokenized .bin files are read as they are. BatchLoader draws windows
from a stream in an order set by (seed, step) alone, so every data-parallel layout sees the same global batches.

JSON lines with a prompt (data.jsonl_prompt_field) are (id, text, prompt_chars) documents whose first
prompt_chars characters are the prompt: the loss does not count its tokens, which the stream holds as
id + vocabulary size (TokenData.shift).
"""
from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import re
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from sixfold.checkpoint import file_sha256
from sixfold.config import DataConfig, bpe_size_problem
from sixfold import corpus
from sixfold.corpus import Corpus, DataError, _corpus, _docs_hash, _unreadable
from sixfold.files import written
from sixfold.model.documents import document_ids
from sixfold.parallel.tensor import IGNORE_INDEX

EOT = "<|endoftext|>"  # sixfold's BPE's end of text, and GPT-2's
OTHER_ENDS = ("<|end_of_text|>", "</s>")  # as special tokens, the end of text of Llama 3's, and Llama 2's and Mistral's
CACHE_FORMAT = "sixfold-tokens-2"  # 2: few documents split by tokens (split_documents)
# a changed reader makes new cache indexes
_READER = hashlib.sha256(b"".join(Path(m).read_bytes() for m in (__file__, corpus.__file__))).hexdigest()
# BPE training's time grows with the square of a word's length: runs of non-space characters this long are cut
# into words of at most this many for it (a line of base64 or minified code would otherwise stall it for hours)
LONG_RUN = re.compile(r"\S{64}")
# a longer document is tokenized (and BPE trained on it) in pieces of at least this many characters, cut where the
# tokenizer's tokens do not cross (its `cut`): one piece at a time, a 100 MB file no longer takes gigabytes
PIECE = 1 << 16
CHUNK = 1 << 23  # characters of pieces encoded at once (in parallel by a tokenizers' tokenizer)
# a cut is taken where the text around it, this many characters each side, encodes as its two sides do; of the
# places `cut` finds after a piece's PIECE characters, the first TRIES are tried, and failing those it goes on whole
AROUND, TRIES = 256, 16
ANYWHERE = re.compile("")  # the byte tokenizer's cut: every character's bytes are its own tokens
# before a space, or after a newline, between two non-space characters: where the pre-tokenizer of a byte-level
# BPE (GPT-2's, Llama 3's) ends a word, and what follows does not depend on what came before
WORD_CUT = re.compile(r"(?<=\S)(?= \S)|(?<=\S\n)(?=\S)")
# text that a tokenizer must encode as its pieces at WORD_CUT do for its documents to be cut there
CUT_PROBE = ("def f(x):\n    return x  \nif a:\nb\n)\n(\n1\n2\n'\n's\n\u00c4\n\u00df\n<|endoftext|>\nz.\n.z\n"
             "a b 1 2 a1 2b ( ) don 't I 'll x.y z \u00e9t\u00e9 \U0001f642 \u4e2d\u6587 <|endoftext|> end")


def _sha(*parts) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


@contextmanager
def _lock(path: Path):
    """Hold an exclusive lock beside `path` so one process builds it while the others wait; what fails to be written
    inside (a full disk, a quota) is refused naming data.cache_dir (the corpus's own read errors are DataErrors)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.with_name(path.name + ".lock"), "w")
    except OSError as e:
        raise DataError(f"cannot write the cache in {path.parent} ({e}); set data.cache_dir") from None
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        except OSError as e:
            raise DataError(f"cannot write the cache in {path.parent} ({e}); free space there or set "
                            f"data.cache_dir") from None


# ---- tokenizers ----

class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; end-of-text is 256."""
    name = "byte"
    vocab_size = 257
    eot, eot_token = 256, EOT
    start, start_token = (), None  # no token before a text
    cut = ANYWHERE

    def pieces(self, text: str) -> list[str]:
        """text in pieces to tokenize one at a time (cut_text): their tokens are the text's."""
        return cut_text(text, self.cut)

    def encode(self, text: str, specials: bool = False) -> list[int]:
        return list(text.encode("utf-8"))  # (no special token is spelt by text)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's tokens, without the start tokens (see BPETokenizer)."""
        return [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]

    def encode_prompted(self, docs: list[tuple[str, int]]) -> list[tuple[np.ndarray, int]]:
        """BPETokenizer.encode_prompted's (tokens, how many are the prompt's), in bytes."""
        return [(np.frombuffer(text.encode("utf-8"), np.uint8), len(text[:k].encode("utf-8"))) for text, k in docs]

    def to_json(self) -> str:
        """These ids as an HF `tokenizers` file (for transformers' AutoTokenizer): byte-level BPE with no merges,
        each byte its own token, id the byte's value."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        vocab = {char: b for b, char in enumerate(_byte_chars())} | {self.eot_token: self.eot}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([self.eot_token])
        return tok.to_str()

    def decode(self, ids) -> str:
        out, buf = [], bytearray()
        for i in map(int, ids):
            if 0 <= i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace") + (EOT if i == self.eot else "\ufffd"))
            buf.clear()
        return "".join(out) + buf.decode("utf-8", errors="replace")


def _byte_chars() -> list[str]:
    """The character byte-level BPE spells each byte with (by value): printable Latin-1 bytes as themselves, the
    others as the characters from U+0100 on, in order."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
             *range(ord("\u00ae"), ord("\u00ff") + 1)]
    hidden = iter(range(256, 512))
    return [chr(b) if b in shown else chr(next(hidden)) for b in range(256)]


class BPETokenizer:
    """A BPE tokenizer from HF `tokenizers`; its end of text is <|endoftext|>, else the first of OTHER_ENDS that is
    a special token (as in a Llama's tokenizer.json). A text is encoded as its template encodes one (Llama's puts
    its start token, <s> or <|begin_of_text|>, before it) without the tokens the template puts after it."""

    def __init__(self, tok, where: str = "the trained tokenizer"):
        special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
        ends = ([EOT] if tok.token_to_id(EOT) is not None else []) + [t for t in OTHER_ENDS if t in special]
        if not ends:
            raise DataError(f"{where} has no end-of-text token ({EOT}, or {' or '.join(OTHER_ENDS)} as a special "
                            f"token); set data.tokenizer to one that has one, or to bpe")
        self.eot_token = ends[0]
        eot = tok.token_to_id(self.eot_token)
        self.name = "bpe-" + hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]
        tok.encode_special_tokens = True  # text that spells a special token stays text
        # a tokenizer.json may leave gaps in its ids: the vocabulary must reach its largest id
        self._tok, self.eot = tok, eot
        self.path: Path | None = None  # the file it was read from
        self.vocab_size = max(tok.get_vocab_size(), max(tok.get_vocab().values(), default=-1) + 1)
        try:
            probe = tok.encode("a", add_special_tokens=True)
        except Exception as e:  # tokenizers' own errors, e.g. a WordLevel model without its unknown token
            raise DataError(f"{where} cannot encode text ({e}); give a tokenizer.json that can, or 'bpe'") from None
        lead = next((i for i, special in enumerate(probe.special_tokens_mask) if not special), 0)
        self.start = tuple(probe.ids[:lead])
        self.start_token = probe.tokens[0] if lead == 1 else None  # a single start token is a model's bos
        # one that prepends to each text, as Llama 2's does a space, or cannot encode the probe, sees them whole
        try:
            self.cut = WORD_CUT if self._same(*cut_text(CUT_PROBE, WORD_CUT, 1)) else None
        except Exception:  # tokenizers raises its own exception types
            self.cut = None

    @classmethod
    def from_file(cls, path) -> BPETokenizer:
        from tokenizers import Tokenizer
        path = Path(path).expanduser()
        if not path.is_file():
            what = "is not a file" if path.exists() else "does not exist"
            raise DataError(f"data.tokenizer={str(path)!r} {what}; give a tokenizer.json, 'byte' or 'bpe'")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:
            try:  # JSON, but not a tokenizer's: tokenizers names a place in it that may be right
                json.loads(path.read_bytes())
                what = "is JSON but not a tokenizer (a model's tokenizer.json, saved by HF tokenizers)"
            except ValueError:
                what = "is not a tokenizers JSON file"
            except OSError as err:
                raise DataError(f"data.tokenizer={str(path)!r} cannot be read ({err.strerror or err}); fix its "
                                f"permissions or give another tokenizer.json") from None
            raise DataError(f"data.tokenizer={str(path)!r} {what}: {e}") from None
        out = cls(tok, str(path))
        out.path = path
        return out

    @classmethod
    def train(cls, docs, vocab_size: int) -> BPETokenizer:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        if bpe_size_problem(vocab_size):
            raise DataError(f"data.bpe_vocab_size={vocab_size} {bpe_size_problem(vocab_size)}")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator((LONG_RUN.sub("\\g<0>\\n", piece) for doc in docs for piece in cut_text(doc, WORD_CUT)),
                                trainer)
        return cls(tok)

    def save(self, path) -> None:
        with written(Path(path)) as tmp:
            self._tok.save(str(tmp))

    def to_json(self) -> str:
        return self._tok.to_str()

    @classmethod
    def from_json(cls, text: str, where: str) -> BPETokenizer:
        from tokenizers import Tokenizer
        try:
            tok = Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises its own exception types
            raise DataError(f"{where} is not a tokenizers JSON file: {e}") from None
        return cls(tok, where)

    @contextmanager
    def _specials(self, parsed: bool):
        """While in it, a special token's text is that token if `parsed`, else text (as outside it)."""
        self._tok.encode_special_tokens = not parsed
        try:
            yield self._tok
        finally:
            self._tok.encode_special_tokens = True

    def encode(self, text: str, specials: bool = False) -> list[int]:
        """With `specials`, a special token's text in `text` is that token; else it stays text."""
        with self._specials(specials) as tok:
            return [*self.start, *tok.encode(text, add_special_tokens=False).ids]

    def pieces(self, text: str) -> list[str]:
        """text in pieces to tokenize one at a time (cut_text), each cut checked where it is made: their tokens are
        the text's."""
        return cut_text(text, self.cut, checked=self._same)

    def _same(self, *texts: str) -> bool:
        """Whether the texts together encode as each does on its own."""
        ids = [self._tok.encode(t, add_special_tokens=False).ids for t in texts]
        return self._tok.encode("".join(texts), add_special_tokens=False).ids == [i for part in ids for i in part]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's tokens, without the start tokens: a document's first piece takes those."""
        return [np.asarray(e.ids, np.int64) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_prompted(self, docs: list[tuple[str, int]]) -> list[tuple[np.ndarray, int]]:
        """Each (text, prompt_chars)'s tokens, the text encoded whole with its special tokens' text as those tokens
        (a chat template's markers), and how many of them are the prompt's: the start token and those that end
        within its first prompt_chars characters (a token across the boundary is the answer's, so that none of the
        answer is lost: " 4" after a prompt ending in "is ")."""
        with self._specials(True) as tok:
            found = tok.encode_batch([text for text, _ in docs], add_special_tokens=False)
        return [(np.asarray([*self.start, *e.ids], np.int64), len(self.start) + sum(b <= k for _, b in e.offsets))
                for e, (_, k) in zip(found, docs)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


# ---- the run's tokenizer ----

def build_tokenizer(cfg: DataConfig, train_docs, digest: str | None = None):
    """The tokenizer data.tokenizer names; "bpe" is trained on train_docs once and cached (by their _docs_hash,
    `digest` if known)."""
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.tokenizer.endswith(".json"):
        return BPETokenizer.from_file(cfg.tokenizer)
    if cfg.tokenizer != "bpe":
        raise DataError(f"data.tokenizer={cfg.tokenizer!r}: choose byte, bpe or a path to a tokenizer.json")
    key = _sha("bpe", cfg.bpe_vocab_size, digest or _docs_hash(train_docs))[:16]
    path = Path(cfg.cache_dir).expanduser() / f"bpe-{key}.json"
    with _lock(path):
        try:
            return BPETokenizer.from_file(path)  # every process uses the file on disk
        except DataError:  # none yet, or damaged: trained (again)
            BPETokenizer.train((doc[1] for doc in train_docs), cfg.bpe_vocab_size).save(path)
    return BPETokenizer.from_file(path)


def with_tokenizer(cfg: DataConfig, text: bytes) -> DataConfig:
    """cfg reading the tokenizer.json `text` (a checkpoint's), kept in data.cache_dir by its sha256 (written again
    where the copy there is not `text`: damaged since)."""
    path = Path(cfg.cache_dir).expanduser() / f"tokenizer-{hashlib.sha256(text).hexdigest()[:16]}.json"
    if not _holds(path, text):  # (a whole copy: no lock, read-only, as a fresh run reads the cache)
        with _lock(path):
            if not _holds(path, text):
                with written(path) as tmp:
                    tmp.write_bytes(text)
    return replace(cfg, tokenizer=str(path))


def _holds(path: Path, text: bytes) -> bool:
    try:
        return path.read_bytes() == text
    except OSError:  # none yet, or unreadable: written
        return False


# ---- token streams ----

@dataclass
class TokenData:
    train: np.ndarray
    val: np.ndarray
    tokenizer: ByteTokenizer | BPETokenizer
    shift: int = 0  # a prompt's token, which the loss does not count, is held as id + shift (0: none is)
    read: str = ""  # what was read and how it was split, in words

    @property
    def summary(self) -> str:
        return f"{self.read}; {len(self.train):,} train and {len(self.val):,} val tokens"


def _val_count(n: int, val_fraction: float) -> int:
    if n < 2:
        raise DataError(f"the corpus has {n} token(s); at least 2 are needed for train and val; add data")
    return min(n - 1, max(1, int(n * val_fraction))) if val_fraction else 0


def _open(path, dtype) -> np.ndarray:
    """A token stream read in place (an empty one, as data.val_fraction=0 leaves the val split, cannot be mapped)."""
    return np.memmap(path, dtype, mode="r") if os.path.getsize(path) else np.zeros(0, dtype)


def cut_text(text: str, cut: re.Pattern | None, size: int | None = None, checked=None) -> list[str]:
    """text in pieces of at least `size` characters (default PIECE; the last may be shorter), each ending at the
    first match of `cut` from there (where the tokenizer's tokens do not cross, so that the pieces' tokens are the
    text's) at which `checked(before, after)` holds of the AROUND characters each side, if given, of the first
    TRIES. Whole without `cut`, or beyond where none is found."""
    size = size or PIECE
    ends = [0]
    while cut is not None and len(text) - ends[-1] > size:
        found = (m.start() for m in itertools.islice(cut.finditer(text, ends[-1] + size), TRIES)
                 if checked is None or checked(text[max(m.start() - AROUND, 0):m.start()],
                                               text[m.start():m.start() + AROUND]))
        at = next(found, None)
        if at is None:
            break
        ends.append(at)
    return [text[a:b] for a, b in zip(ends, ends[1:] + [len(text)])]


class _Stream:
    """A token stream written as its documents come: their pieces (tok.pieces; a document with a prompt whole)
    gathered into chunks of about CHUNK characters, each encoded in parallel; each document's tokens and an end of
    text, with `shift` its prompt's tokens as id + shift."""

    def __init__(self, f, tok, dtype, shift: int):
        self.f, self.tok, self.dtype, self.shift = f, tok, dtype, shift
        self.start, self.eot, self.none = np.array(tok.start, dtype), np.array([tok.eot], dtype), np.zeros(0, dtype)
        self.chunk, self.size = [], 0  # (text, whether it begins its document, whether it ends it, *prompt)

    def add(self, doc) -> None:
        _, text, *prompt = doc
        pieces = [text] if prompt else self.tok.pieces(text)
        for i, piece in enumerate(pieces):
            self.chunk.append((piece, i == 0, i == len(pieces) - 1, *prompt))
            self.size += len(piece)
            if self.size >= CHUNK:
                self.flush()

    def flush(self) -> None:
        chunk, dtype = self.chunk, self.dtype
        if not chunk:
            return
        if self.shift:
            found = self.tok.encode_prompted([(text, k) for text, _, _, k in chunk])
            parts = [(ids[:n].astype(dtype) + self.shift, ids[n:].astype(dtype, copy=False), self.eot)
                     for ids, n in found]
        else:
            start, eot, none = self.start, self.eot, self.none
            parts = [(start if first else none, ids.astype(dtype, copy=False), eot if last else none)
                     for ids, (_, first, last) in zip(self.tok.encode_batch([p[0] for p in chunk]), chunk)]
        self.f.write(np.concatenate([a for part in parts for a in part]).tobytes())
        self.chunk, self.size = [], 0


def _write_cache(tok, docs: Corpus, train_path: Path, val_path: Path, val_fraction, dtype, shift) -> None:
    """Both streams in one pass over the documents."""
    with written(train_path) as train_tmp:  # moved in last: its presence means both are complete
        with written(val_path) as val_tmp:
            with open(train_tmp, "wb") as train_f, open(val_tmp, "wb") as val_f:
                streams = (_Stream(train_f, tok, dtype, shift), _Stream(val_f, tok, dtype, shift))
                for doc, val in docs.labelled():
                    streams[val].add(doc)
                for stream in streams:
                    stream.flush()
            if not docs.val_count:  # a single document, or too few to hold out whole: the last val_fraction of
                tokens = np.memmap(train_tmp, dtype, mode="r")  # tokens is val
                cut = len(tokens) - _val_count(len(tokens), val_fraction)
                tokens[cut:].tofile(val_tmp)
                del tokens
                os.truncate(train_tmp, cut * np.dtype(dtype).itemsize)


def _check_bin(cfg: DataConfig, p: Path, dtype: np.dtype, vocab_size: int) -> None:
    """Refuse a token file that is empty, not whole tokens of dtype, uint32 ids read as uint16, or holds an id
    outside the vocabulary."""
    size = p.stat().st_size
    if size == 0:
        raise DataError(f"{p} is empty; point data.source at token files with data")
    if size % dtype.itemsize:
        raise DataError(f"{p}: {size} bytes is not a whole number of {dtype} tokens; check data.bin_dtype")
    tokens = np.memmap(p, dtype, mode="r")
    # little-endian uint32 ids below 65536 read as uint16: each high half, at an odd position, is 0
    if dtype == np.uint16 and size % 4 == 0 and not tokens[:1 << 20][1::2].any():
        raise DataError(f"{p} looks like uint32 token ids (every other uint16 in it is 0); set data.bin_dtype=uint32")
    top = int(tokens.max())
    if top >= vocab_size:
        raise DataError(f"{p} holds token {top}, outside the vocabulary of {vocab_size} of "
                        f"data.tokenizer={cfg.tokenizer!r}; set data.tokenizer (or data.bin_dtype) to match, or, if "
                        f"it is not token ids, data.format to read it as text")


def _load_bin(cfg: DataConfig, root: Path, files) -> TokenData:
    if cfg.tokenizer == "bpe":
        raise DataError("data.tokenizer=bpe trains on text, but data.source holds .bin token files; "
                        "set data.tokenizer to byte or the tokenizer.json the files were made with")
    tok = build_tokenizer(cfg, [])
    dtype = np.dtype(cfg.bin_dtype)
    for _, p in files:
        try:
            _check_bin(cfg, p, dtype, tok.vocab_size)
        except OSError as e:
            raise _unreadable(p, e) from None
    path = files[0][1]
    if len(files) > 1:  # concatenated once into the cache
        stats = [(i, *_stamp(p)) for i, p in files]
        path = Path(cfg.cache_dir).expanduser() / f"tokens-{_sha(CACHE_FORMAT, str(root), str(dtype), stats)[:32]}.bin"
        sums = path.with_suffix(".sha256")
        if not _whole_bin(path, sums):  # none yet, or cut short or overwritten since (a whole one: no lock, read-only)
            with _lock(path):
                if not _whole_bin(path, sums):
                    with written(path) as tmp, open(tmp, "wb") as out:
                        for _, p in files:
                            with open(p, "rb") as f:
                                shutil.copyfileobj(f, out, 1 << 24)
                    with written(sums) as tmp:
                        tmp.write_text(json.dumps({"sha256": file_sha256(path), "stamp": _stamp(path)}))
    tokens = np.memmap(path, dtype, mode="r")
    stopped = ""
    if cfg.max_bytes and tokens.nbytes > cfg.max_bytes:  # as of text: only the first data.max_bytes (of tokens)
        tokens, stopped = tokens[:cfg.max_bytes // dtype.itemsize], f", data.max_bytes={cfg.max_bytes:,} reached"
        if len(tokens) < 2:  # (_val_count's "add data" would mislead)
            raise DataError(f"data.max_bytes={cfg.max_bytes:,} holds {len(tokens)} {dtype} token(s) of {root}; raise "
                            f"data.max_bytes (or set it to 0, all of them)")
    cut = len(tokens) - _val_count(len(tokens), cfg.val_fraction)
    n = len(files)
    return TokenData(tokens[:cut], tokens[cut:], tok, read=f"{n:,} token file{'s' * (n > 1)} in {root}{stopped}, "
                                                          f"{'their' if n > 1 else 'its'} last tokens held out")


def _whole_bin(path: Path, sums: Path) -> bool:
    """Whether the concatenated token files at `path` are as written: unchanged since (_stamp), or else their sha256
    as recorded then."""
    try:
        recorded = json.loads(sums.read_text())
        return path.is_file() and (recorded["stamp"] == _stamp(path) or recorded["sha256"] == file_sha256(path))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _index_path(cfg: DataConfig, root: Path, files) -> Path:
    """Where the cache names the streams of this corpus as it stands on disk, so a load that finds it reads no
    text: keyed by each file's identity, size and times (a rewrite that restores the modification time changes
    the change time), the settings, and this module's source (how documents are read)."""
    def stat(p: Path):
        try:
            return str(p), *_stamp(p)
        except OSError as e:
            raise _unreadable(p, e) from None
    tok = Path(cfg.tokenizer).expanduser()
    tok = stat(tok) if cfg.tokenizer.endswith(".json") and tok.is_file() else cfg.tokenizer
    key = _sha(CACHE_FORMAT, _READER, cfg.source == "stdlib", str(root), cfg.format, cfg.jsonl_field,
               cfg.jsonl_prompt_field, tok,
               cfg.bpe_vocab_size, cfg.max_bytes, cfg.val_fraction, [(i, *stat(p)) for i, p in files])[:32]
    return Path(cfg.cache_dir).expanduser() / f"index-{key}.json"


def _stamp(path: Path) -> list[int]:
    """A cached stream's identity, size and times: a rewrite that restores the modification time changes the
    change time (as do a rename or chmod, after which the stream is checked again)."""
    st = path.stat()
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _sums_path(train_path: Path) -> Path:
    return train_path.with_name(train_path.name.removesuffix(".train.bin") + ".sha256")


def _sums(train_path: Path, val_path: Path) -> dict[str, str]:
    return {"train": file_sha256(train_path), "val": file_sha256(val_path)}


def _intact(train_path: Path, val_path: Path) -> bool:
    """Whether cached streams hold what was written (their sha256 as recorded then): tokenizing again is slower
    than reading them, and a stream cut short or overwritten would train on the wrong tokens."""
    try:
        return json.loads(_sums_path(train_path).read_text()) == _sums(train_path, val_path)
    except (OSError, ValueError):
        return False


def _from_index(index: Path) -> TokenData | None:
    """The streams and tokenizer an index names, or None if it or any of them is missing, unreadable or changed
    since (_stamp); the warnings of the corpus's first read are given again."""
    try:
        entry = json.loads(index.read_text())
        if [_stamp(Path(entry[k])) for k in ("train", "val")] != entry["stamps"]:
            warnings.warn(f"the token cache {entry['train']} changed since {index} named it: checking it against "
                          f"the corpus", stacklevel=3)
            return None
        dtype = np.dtype(entry["dtype"])
        tok = ByteTokenizer() if entry["tokenizer"] == "byte" else BPETokenizer.from_file(entry["tokenizer"])
        data = TokenData(_open(entry["train"], dtype), _open(entry["val"], dtype), tok, entry["shift"],
                         entry.get("read", ""))
        said = [str(w) for w in entry.get("warnings", [])]
    except (OSError, ValueError, KeyError, TypeError, DataError):
        return None
    for message in said:
        warnings.warn(message, stacklevel=3)
    return data


@contextmanager
def _recorded(said: list):
    """The warnings given inside, added to `said` and given (also when it raises)."""
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        said += caught
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _doubled_start(tok, docs) -> None:
    """Warn of prompted documents whose text begins with the start token that the tokenizer puts before each (as a
    chat template's output does): they hold it twice."""
    mark = tok.start_token
    count = sum(text.startswith(mark) for _, text, _ in docs) if mark else 0
    if count:
        warnings.warn(f"{count} of {len(docs)} prompt(s) begin with {mark}, and the tokenizer puts one before each "
                      f"text: those documents begin with it twice (as transformers encodes such text); leave it out "
                      f"of the prompts (a chat template writes it)")


def load_data(cfg: DataConfig) -> TokenData:
    """Train and val token streams (memory-mapped, cached in data.cache_dir) and their tokenizer."""
    kind, root, files = _corpus(cfg)
    if kind == "bin" and cfg.jsonl_prompt_field:
        raise DataError(f"data.source={cfg.source!r} holds pre-tokenized .bin files, which have no prompts for "
                        f"data.jsonl_prompt_field={cfg.jsonl_prompt_field!r}; point data.source at .jsonl files, or "
                        f"leave data.jsonl_prompt_field unset")
    if kind == "bin":
        return _load_bin(cfg, root, files)
    index = _index_path(cfg, root, files)
    found = _from_index(index)
    if found is not None:
        return found
    tok = None if cfg.tokenizer == "bpe" else build_tokenizer(cfg, [])  # a wrong name or file: before the corpus
    said: list = []  # what reading the corpus warned of, given again when the cache is read
    with _recorded(said):  # also when no document was found: the lines or files skipped say why
        docs = Corpus(cfg, root, files)
    train_docs, val_docs, read = docs.part(False), docs.part(True), docs.read
    read += f", {len(val_docs):,} of them held out" if val_docs else \
        f", {'its' if len(train_docs) == 1 else 'their'} last tokens held out" if cfg.val_fraction else ""
    if tok is None:
        tok = build_tokenizer(cfg, train_docs, docs.train_digest)
    if cfg.jsonl_prompt_field:
        with _recorded(said):
            _doubled_start(tok, docs)
    shift = tok.vocab_size if cfg.jsonl_prompt_field else 0
    dtype = np.uint16 if tok.vocab_size + shift < 65536 else np.uint32
    key = _sha(CACHE_FORMAT, cfg.source == "stdlib", str(root), cfg.format, cfg.jsonl_field, cfg.jsonl_prompt_field,
               docs.digest, tok.name, tok.start, cfg.max_bytes, cfg.val_fraction)[:32]
    cache = Path(cfg.cache_dir).expanduser()
    train_path, val_path = cache / f"tokens-{key}.train.bin", cache / f"tokens-{key}.val.bin"
    with _lock(train_path):
        if not (train_path.exists() and val_path.exists() and _intact(train_path, val_path)):
            _write_cache(tok, docs, train_path, val_path, cfg.val_fraction, dtype, shift)
            with written(_sums_path(train_path)) as tmp:
                tmp.write_text(json.dumps(_sums(train_path, val_path)))
        tok_file = "byte" if isinstance(tok, ByteTokenizer) else str(tok.path)
        with written(index) as tmp:
            tmp.write_text(json.dumps({"train": str(train_path), "val": str(val_path), "dtype": np.dtype(dtype).name,
                                       "shift": shift, "tokenizer": tok_file, "read": read,
                                       "warnings": [str(w.message) for w in said],
                                       "stamps": [_stamp(train_path), _stamp(val_path)]}))
    return TokenData(_open(train_path, dtype), _open(val_path, dtype), tok, shift, read)


# ---- batches ----

def _windows(tokens: np.ndarray, starts, seq_len: int, shift: int, eot: int | None) -> tuple:
    """(inputs, labels, document ids of the inputs or None) of the windows at `starts`; a prompt's token (id + shift)
    is no label, and a prompt's end of text (a chat template's marker) closes no document."""
    rows = np.stack([np.asarray(tokens[s:s + seq_len + 1]) for s in starts]).astype(np.int64)
    rows = torch.from_numpy(rows)
    ids = None if eot is None else document_ids(rows[:, :-1], eot)
    if shift:
        prompt = rows >= shift
        rows = rows - shift * prompt
        return rows[:, :-1].contiguous(), rows[:, 1:].masked_fill(prompt[:, 1:], IGNORE_INDEX), ids
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous(), ids


def _rank_rows(batch: int, batch_index: int, batch_count: int) -> range:
    if batch_count < 1 or batch % batch_count or not 0 <= batch_index < batch_count:
        raise DataError(f"a batch of {batch} rows cannot be split evenly into {batch_count} parts "
                        f"(part {batch_index}); change train.global_batch or the data-parallel size")
    b = batch // batch_count
    return range(batch_index * b, (batch_index + 1) * b)


class BatchLoader:
    """Deterministic batches: the global sample order is a function of (seed, step) only."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int,
                 batch_index: int = 0, batch_count: int = 1, shift: int = 0, eot: int | None = None):
        self.samples = (len(tokens) - 1) // seq_len if seq_len > 0 else 0
        if self.samples <= 0:
            raise DataError(f"the train split has fewer than seq_len+1 = {seq_len + 1} tokens ({len(tokens)}); "
                            "lower train.seq_len or add data (or raise data.max_bytes, if set)")
        self.rows = _rank_rows(global_batch, batch_index, batch_count)
        self.batch_index, self.batch_count = batch_index, batch_count
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed
        self.shift = shift  # TokenData.shift
        self.eot = eot  # the tokenizer's end of text: batches give document ids (data.document_mask)
        self.next_step = 0
        self._epoch, self._perm = -1, None

    def _order(self, epoch: int) -> torch.Tensor:
        """The sample permutation of one epoch; the current one is kept."""
        if epoch != self._epoch:
            seed = int.from_bytes(hashlib.sha256(f"{self.seed}:{epoch}".encode()).digest()[:8], "big") >> 1
            self._perm = torch.randperm(self.samples, generator=torch.Generator().manual_seed(seed))
            self._epoch = epoch
        return self._perm

    def batch(self, step: int, rows=None) -> tuple:
        """(inputs, labels, document ids or None), int64 [rows of this rank, seq_len]; labels are inputs shifted by
        one; ids only if the loader was given `eot`."""
        starts = []
        for j in self.rows if rows is None else rows:
            g = step * self.global_batch + j
            starts.append(int(self._order(g // self.samples)[g % self.samples]) * self.seq_len)
        return _windows(self.tokens, starts, self.seq_len, self.shift, self.eot)

    def micro_batches(self, step: int, n: int) -> list[tuple]:
        """This rank's part of each of the n micro-batches of the step. Micro-batch i is the same slice
        i of the global batch in every layout (what MoE load statistics are taken over)."""
        if n < 1 or len(self.rows) % n:
            raise DataError(f"{len(self.rows)} rows per rank cannot be split into train.micro_batches={n}")
        per = self.global_batch // n
        mine = _rank_rows(per, self.batch_index, self.batch_count)
        return [self.batch(step, range(i * per + mine.start, i * per + mine.stop)) for i in range(n)]

    def state_dict(self) -> dict:
        return {"seed": self.seed, "seq_len": self.seq_len, "global_batch": self.global_batch,
                "next_step": self.next_step}

    def load_state_dict(self, state: dict) -> dict:
        """Go on from the saved step; returns the settings of the saved order that this loader's differ in
        ({key: (saved, this)}), whose batches from that step on are then this loader's own."""
        self.next_step = int(state["next_step"])
        return {k: (state.get(k), getattr(self, k)) for k in ("seed", "seq_len", "global_batch")
                if state.get(k) != getattr(self, k)}


def eval_batches(tokens: np.ndarray, seq_len: int, batch: int, count: int, batch_index: int = 0,
                 batch_count: int = 1, shift: int = 0, eot: int | None = None) -> list[tuple]:
    """`count` fixed batches (as BatchLoader.batch's) of the first windows of `tokens` in order (wrapping), this
    rank's rows of each."""
    n = (len(tokens) - 1) // seq_len if seq_len > 0 else 0
    if n <= 0:
        raise DataError(f"the val split has fewer than seq_len+1 = {seq_len + 1} tokens ({len(tokens)}); lower "
                        f"train.seq_len, add documents or raise data.val_fraction (the split holds out whole documents "
                        f"by a hash of their names, or a few documents' last tokens), or set train.eval_every=0 to "
                        f"train without validation")
    rows = _rank_rows(batch, batch_index, batch_count)
    return [_windows(tokens, [((i * batch + j) % n) * seq_len for j in rows], seq_len, shift, eot)
            for i in range(count)]
