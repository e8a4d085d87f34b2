"""A corpus read into documents: data.source's files listed (the standard library, a file, a directory or a
pattern), read as text or JSON lines, and each document drawn to train or val by a hash of its id. Documents are
read again at each pass over them rather than held (Corpus), so that a corpus is tokenized in about the memory of
its largest file."""
from __future__ import annotations

import codecs
import fnmatch
import hashlib
import itertools
import json
import os
import re
import sysconfig
import warnings
from array import array
from pathlib import Path

from sixfold.checkpoint import META, META_SHA256
from sixfold.config import DataConfig, checkpoint_over, run_directory

SPLIT_SLACK = 4  # the held-out documents hold at most this many times data.val_fraction of the text
STDLIB_SKIP = {"site-packages", "dist-packages", "__pycache__"}
WILDCARD = re.compile(r"[*?[]")  # data.source as a pattern (_glob)
STRAY_BYTES = 1000  # a text with up to one byte in this many (of those read) not UTF-8 is read, each as U+FFFD
STRAY = re.compile("[\udc80-\udcff]")  # a byte that is not UTF-8, decoded with surrogateescape
# the names of the files sixfold.data writes in data.cache_dir (left out of a corpus listed there)
CACHE_FILE = re.compile(r"(bpe|tokenizer|tokens|index)-[0-9a-f]+(\.train|\.val)?\.(bin|json|sha256)(\.lock)?")
# what marks a directory as a token cache, data.cache_dir now or in an earlier run: a stream's checksums
CACHE_MARK = re.compile(r"tokens-[0-9a-f]{32}\.sha256")


def _in_cache(real: str, names, cache: str | None) -> bool:
    """Whether directory `real` (holding `names`) is a token cache: data.cache_dir's, or another run's (CACHE_MARK),
    whose files are no corpus either."""
    return real == cache or any(CACHE_MARK.fullmatch(n) for n in names)


class DataError(ValueError):
    """A corpus, tokenizer or batch setting that cannot work; the message names what to change."""


def _docs_hash(docs) -> str:
    hashed = _DocsHash()
    for doc in docs:
        hashed.add(doc)
    return hashed.h.hexdigest()


def _sixfold_output(d: Path) -> bool:
    """Whether directory d is one sixfold writes: a run directory (config.run_directory, or one that holds
    checkpoints/latest) or a checkpoint (meta.json with meta.sha256)."""
    return run_directory(d) or (d / "checkpoints" / "latest").is_file() or \
        ((d / META).is_file() and (d / META_SHA256).is_file())


def _file_identity(p: Path):
    """The file a name leads to, the same for each of its names: symbolic links followed, and hard links (one
    inode) alike."""
    try:
        st = p.stat()
        return st.st_dev, st.st_ino
    except OSError:  # (refused by name when read)
        return os.path.realpath(p)


def _walk(root: Path, skip=(), cache: Path | None = None) -> tuple[list[tuple[str, Path]], list[str]]:
    """(relative path, file) for every regular, non-hidden file under root, sorted, and what was left out as
    sixfold's own: directories below root that sixfold writes (_sixfold_output), and the token cache's files
    (CACHE_FILE) in `cache`, not the whole directory, which may be root. Linked directories are followed, each
    real directory once; each real file is listed once, by its first name."""
    out, own, seen = [], [], {os.path.realpath(root)}
    cache = os.path.realpath(cache) if cache else None
    for d, dirs, names in os.walk(root, followlinks=True):
        dirs[:] = [x for x in sorted(dirs) if not x.startswith(".") and x not in skip]
        kept = []
        for x in dirs:  # each real directory once, also where two links lead to one
            real = os.path.realpath(os.path.join(d, x))
            if real not in seen:
                seen.add(real)
                kept.append(x)
        dirs[:] = kept
        mine = [x for x in dirs if _sixfold_output(Path(d, x))]
        own += [Path(d, x) for x in mine]
        dirs[:] = [x for x in dirs if x not in mine]
        in_cache = _in_cache(os.path.realpath(d), names, cache)
        for n in names:
            p = Path(d, n)
            if in_cache and CACHE_FILE.fullmatch(n):
                own.append(p)
            elif not n.startswith(".") and p.is_file():
                out.append((p.relative_to(root).as_posix(), p))
    return _once(out), sorted(p.relative_to(root).as_posix() for p in own)


def _once(named) -> list[tuple[str, Path]]:
    """(name, file) sorted, a file that links (symbolic or hard) lead to by several names once, by its first name
    (else read in both splits); a directory and a pattern name it alike."""
    once = {}
    for name, p in sorted(named):
        once.setdefault(_file_identity(p), (name, p))
    return sorted(once.values())


def _glob(pattern: Path, cache: Path) -> tuple[Path, list[tuple[str, Path]], list[str]]:
    """data.source as a pattern (`*`, `?` and `[...]` within a name, `**` any depth of directories): the directory
    before its first wildcard, the files under it that the rest matches (sorted, as _walk gives them), and sixfold's
    own that it skipped there. Only directories the pattern can reach are read; a hidden name matches only a part
    that starts with '.'; linked directories are followed, each real one once a part of the pattern."""
    parts = pattern.parts
    first = next(i for i, part in enumerate(parts) if WILDCARD.search(part))
    root = Path(*parts[:first]).resolve() if first else Path.cwd()
    rest = parts[first:] + (("*",) if parts[-1] == "**" else ())
    found, own, seen, cache = [], [], set(), os.path.realpath(cache)

    def descend(d: Path, rest: tuple[str, ...]) -> None:
        real = os.path.realpath(d)
        if (real, rest) in seen:
            return
        seen.add((real, rest))
        head, tail = rest[0], rest[1:]
        if head == "**":
            descend(d, tail)  # no directory
        try:
            entries = sorted(e.name for e in os.scandir(d))
        except OSError:  # unreadable: skipped, as os.walk does
            return
        in_cache = _in_cache(real, entries, cache)
        for name in entries:
            p = Path(d, name)
            hidden = name.startswith(".") and not head.startswith(".")
            try:
                if hidden or not (head == "**" or fnmatch.fnmatchcase(name, head)):
                    continue
                if tail and p.is_dir():
                    if _sixfold_output(p):
                        own.append(p)
                    else:
                        descend(p, rest if head == "**" else tail)
                elif not tail and p.is_file():
                    if in_cache and CACHE_FILE.fullmatch(name):
                        own.append(p)
                    else:
                        found.append(p)
            except OSError:  # a name that cannot be looked at (/proc's): not corpus
                continue

    if root.is_dir():
        descend(root, rest)
    return root, _once((p.relative_to(root).as_posix(), p) for p in found), \
        sorted({o.relative_to(root).as_posix() for o in own})


SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".bin": "bin"}  # data.format=auto by the name (any case)


def _format(cfg: DataConfig, path: Path) -> str:
    if cfg.format != "auto":
        return cfg.format
    if path.suffix.lower() == ".json":  # JSON lines by another name (as some exporters write them), or a document
        return "jsonl" if _json_lines(path) else "text"
    return SUFFIXES.get(path.suffix.lower(), "text")


def _json_lines(path: Path) -> bool:
    """Whether the file's first two lines that are not blank are each a JSON object."""
    try:
        with open(path, "rb") as f:
            lines = [line for line in itertools.islice(f, 1000) if line.strip()][:2]
        return len(lines) == 2 and all(isinstance(json.loads(line), dict) for line in lines)
    except (OSError, ValueError, RecursionError):  # unreadable: refused as text when read; not JSON lines
        return False


def _corpus(cfg: DataConfig) -> tuple[str, Path, list[tuple[str, Path]]]:
    """(kind, root, [(id, file)]) for data.source; kind is "bin" for pre-tokenized files, else "text". Sixfold's own
    directories and files in a directory (_walk) are left out, with a warning."""
    if cfg.source == "stdlib":
        if cfg.format not in ("auto", "text"):
            raise DataError(f"data.source=stdlib is Python source text; set data.format=auto, not {cfg.format}")
        root = Path(sysconfig.get_paths()["stdlib"])
        return "text", root, [(i, p) for i, p in _walk(root, STDLIB_SKIP)[0] if i.endswith(".py")]
    root, cache = Path(cfg.source).expanduser(), Path(cfg.cache_dir).expanduser()
    if not root.exists() and WILDCARD.search(cfg.source):
        root, files, own = _glob(root, cache)
        if not files:
            raise DataError(f"data.source={cfg.source!r} matches no files under {root}")
    else:
        root = Path(os.path.realpath(root))  # (Path.resolve raises for a loop of links before Python 3.13)
        if not root.exists():
            raise DataError(f"data.source={cfg.source!r}: {root} does not exist; give a file, a directory, a pattern "
                            "or 'stdlib'")
        holder = (root if _sixfold_output(root) else checkpoint_over(root, itself=True)) if root.is_dir() else None
        if holder:
            where = "" if holder == root else f" (inside {holder})"
            raise DataError(f"data.source={cfg.source!r}: {root} is a sixfold run directory or checkpoint{where}, "
                            f"whose files are no corpus; point data.source at the directory of the text files")
        if not (root.is_file() or root.is_dir()):
            raise DataError(f"data.source={cfg.source!r}: {root} is neither a regular file nor a directory (a device, "
                            f"pipe or socket); point data.source at a file, a directory or a pattern of text files")
        files, own = ([(root.name, root)], []) if root.is_file() else _walk(root, cache=cache)
    if own:  # said on every load: the corpus is listed before the cache is looked in
        warnings.warn(f"skipped {len(own)} of sixfold's own directories and files in {root} (run directories, "
                      f"checkpoints, the token cache of data.cache_dir): {', '.join(own[:5])}"
                      f"{' ...' if len(own) > 5 else ''}", stacklevel=3)
    if cfg.format == "bin" and root.is_dir():
        files = [f for f in files if f[1].suffix.lower() == ".bin"]
    if not files:
        raise DataError(f"data.source={cfg.source!r}: {root} holds no {'.bin ' if cfg.format == 'bin' else ''}files")
    kinds = {_format(cfg, p) == "bin": p for _, p in files}
    if len(kinds) > 1:
        raise DataError(f"data.source={cfg.source!r}: {root} mixes .bin token files ({kinds[True]}, ...) with text "
                        f"files ({kinds[False]}, ...); point data.source at a directory or pattern of one kind "
                        f"(data/*.txt), or set data.format=bin to read only the .bin files")
    return ("bin" if True in kinds else "text"), root, files


def _utf8(value: str) -> str:
    """JSON may escape a lone surrogate, which UTF-8 cannot hold: U+FFFD in its place (the length kept)."""
    return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _jsonl_doc(doc_id: str, n: int, line: str, fields: list[str]) -> tuple | None:
    """Line n's document: (id, the text field), or with a prompt field before it (id, prompt + text, characters
    of prompt); None if it holds none."""
    try:
        obj = json.loads(line)
        values = [obj[f] for f in fields]
    except (ValueError, KeyError, TypeError, RecursionError):  # (JSON nested deeper than Python's recursion limit)
        return None
    if not all(isinstance(v, str) for v in values):
        return None
    values = [_utf8(v) for v in values]
    doc = (f"{doc_id}:{n}", "".join(values))
    return doc + (len(values[0]),) if len(fields) == 2 else doc


def _decoded(raw: bytes, codec: str = "utf-8", final: bool = True) -> tuple[str, int]:
    """raw's text and how many stray bytes it held, each read as U+FFFD (codec utf-8-sig drops a byte-order mark;
    not `final`, a character cut at the end is left out)."""
    def decode(errors: str) -> str:  # (a decoder object only to leave a cut character out: a tenth of the speed)
        return raw.decode(codec, errors) if final else codecs.getincrementaldecoder(codec)(errors).decode(raw)

    try:
        return decode("strict"), 0
    except UnicodeDecodeError:  # each stray byte decodes to a lone surrogate of its own, then U+FFFD
        return STRAY.subn("\ufffd", decode("surrogateescape"))


def _check_stray(stray: int, read: int) -> None:
    """Up to one byte in STRAY_BYTES of those read may be stray (a text with a stray byte); more: not UTF-8."""
    if stray * STRAY_BYTES > read:
        raise UnicodeDecodeError("utf-8", b"", 0, 0, f"{stray} of {read} bytes are not UTF-8")


def _jsonl_docs(cfg: DataConfig, path: Path, doc_id: str, left: int, warn: bool):
    """A JSONL file's documents (_jsonl_doc), read a line at a time (a leading byte-order mark dropped); with `left`
    (bytes of text data.max_bytes still takes), only until its documents hold that much. Returns its stray bytes;
    raises UnicodeDecodeError, once its lines are read, for more than _check_stray allows (a NUL is refused with
    its line). `warn`: of lines that hold no document."""
    fields = [cfg.jsonl_prompt_field, cfg.jsonl_field] if cfg.jsonl_prompt_field else [cfg.jsonl_field]
    bad, skipped, stray, read, held = [], 0, 0, 0, 0  # the first 10 lines that hold none, and how many do
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            read += len(raw)
            line, found = _decoded(raw, "utf-8-sig" if n == 1 else "utf-8")
            stray += found
            if not line.strip():
                continue
            doc = _jsonl_doc(doc_id, n, line, fields)
            if doc is None:
                bad += [n] if len(bad) < 10 else []
                skipped += 1
                continue
            yield doc
            held += len(doc[1].encode()) if left else 0
            if left and held >= left:
                break
    _check_stray(stray, read)
    if bad and warn:
        named = " and ".join(f"{f!r}" for f in fields)
        keys = "data.jsonl_prompt_field and data.jsonl_field" if cfg.jsonl_prompt_field else "data.jsonl_field"
        warnings.warn(f"{path}:{bad[0]}: skipped {skipped} line(s) that are not JSON objects with string "
                      f"field(s) {named} ({keys}); lines {bad}", stacklevel=6)  # (load_data's caller)
    return stray


def _file_docs(cfg: DataConfig, path: Path, jsonl: bool, doc_id: str, left: int, warn: bool):
    """A file's documents (JSON lines, or its text as one); returns (whether the limit cut it, its stray bytes)."""
    if jsonl:
        return False, (yield from _jsonl_docs(cfg, path, doc_id, left, warn))
    text, cut, stray = _text(path, left)
    yield doc_id, text
    return cut, stray


def _text(path: Path, limit: int) -> tuple[str, bool, int]:
    """A UTF-8 file's text (a leading byte-order mark dropped), whether the limit cut it, and how many stray bytes
    it held (_decoded, _check_stray): with a limit, at most that many bytes, a character it cuts left out. Raises
    UnicodeDecodeError for a NUL byte, which text files do not hold and binary ones do (all-zero bytes are UTF-8)."""
    with open(path, "rb") as f:
        raw = f.read(limit + 1) if limit else f.read()
    cut = bool(limit) and len(raw) > limit
    raw = raw[:limit] if cut else raw
    if b"\0" in raw:
        at = raw.index(b"\0")
        raise UnicodeDecodeError("utf-8", raw, at, at + 1, "a NUL byte: binary data")
    text, stray = _decoded(raw, "utf-8-sig", final=not cut)
    _check_stray(stray, len(raw))
    return text, cut, stray


def _unreadable(path: Path, e: OSError) -> DataError:
    if isinstance(e, FileNotFoundError):  # listed, then removed or renamed
        return DataError(f"{path} is gone since data.source was listed; leave its files as they are while sixfold "
                         f"reads them, then run again")
    return DataError(f"{path} cannot be read ({e.strerror or e}); fix its permissions or remove it from data.source")


def _read(cfg: DataConfig, files, warn: bool = True):
    """One pass over the files in order: ("doc", i, (id, text)) for each document of files[i] (with
    data.jsonl_prompt_field, (id, text, prompt_chars)), up to data.max_bytes of text (a text file read only as far
    as that), then ("end", i, its stray bytes) once the file is read whole, or ("bad", i, None) if it is not UTF-8
    (the documents it gave before then are not to be kept). An unreadable file is refused."""
    taken = 0
    for i, (doc_id, path) in enumerate(files):
        jsonl = _format(cfg, path) == "jsonl"
        if cfg.jsonl_prompt_field and not jsonl:
            raise DataError(f"{path} is not JSON lines, and data.jsonl_prompt_field={cfg.jsonl_prompt_field!r} reads "
                            f"prompts from JSON lines; point data.source at .jsonl files, or leave "
                            f"data.jsonl_prompt_field unset")
        before, full = taken, False
        reader = _file_docs(cfg, path, jsonl, doc_id, cfg.max_bytes - taken if cfg.max_bytes else 0, warn)
        try:
            while True:
                try:
                    name, text, *prompt = next(reader)
                except StopIteration as done:
                    cut, stray = done.value
                    break
                if full:
                    continue
                if cfg.max_bytes:
                    raw = text.encode()
                    # a prompt-and-answer document cut short would teach its end of text mid-answer: left out
                    cut_short = prompt and len(raw) > cfg.max_bytes - taken
                    text = "" if cut_short else raw[:cfg.max_bytes - taken].decode("utf-8", errors="ignore")
                    taken += len(raw)
                    full = taken >= cfg.max_bytes
                if text:
                    yield "doc", i, (name, text, *[min(k, len(text)) for k in prompt])
        except UnicodeDecodeError:
            taken = before
            yield "bad", i, None
            continue
        except OSError as e:
            raise _unreadable(path, e) from None
        yield "end", i, stray
        if cut or full:
            break
    yield "done", None, taken


class _DocsHash:
    """sha256 of documents, each field's length and bytes in turn."""

    def __init__(self):
        self.h = hashlib.sha256()

    def add(self, doc) -> None:
        for s in (doc[0], doc[1], *map(str, doc[2:])):
            b = _encoded(s)
            self.h.update(len(b).to_bytes(8, "little"))
            self.h.update(b)


class Corpus:
    """The documents of data.source's files in order, read from the files at each pass rather than held: a corpus
    is tokenized in about the memory of its largest file (and 17 bytes a document). The first pass counts them,
    draws the val split (_val_flags), hashes them (all, and the train split's) and says what it skipped; each
    later pass reads the files it kept and checks that it read the same documents."""

    def __init__(self, cfg: DataConfig, root: Path, files):
        self.cfg, self.kept, keys, sizes = cfg, [], array("d"), array("q")
        skipped, mended, hashed, train, read, taken = [], [], _DocsHash(), _DocsHash(), 0, 0
        mark = (0, hashed.h.copy(), train.h.copy())  # at the start of the file being read: documents, hashes
        for kind, i, value in _read(cfg, files):
            if kind == "doc":
                keys.append(_val_key(value[0]))
                sizes.append(len(value[1]))
                hashed.add(value)
                if keys[-1] >= cfg.val_fraction:  # train, unless the split is dropped (_val_flags)
                    train.add(value)
                continue
            if kind == "done":
                taken = value
                continue
            if kind == "end":
                self.kept.append(files[i])
                mended += [f"{files[i][1]} ({value})"] if value else []
            else:  # not UTF-8: what it gave is dropped
                del keys[mark[0]:], sizes[mark[0]:]
                hashed.h, train.h = mark[1:]
                skipped.append(str(files[i][1]))
            read, mark = i + 1, (len(keys), hashed.h.copy(), train.h.copy())
        if skipped:
            warnings.warn(f"skipped {len(skipped)} file(s) that are not UTF-8 text (or hold NUL bytes, as binary "
                          f"files do): {', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}", stacklevel=2)
        if mended:
            warnings.warn(f"read {len(mended)} file(s) with a few bytes that are not UTF-8 (at most 1 in "
                          f"{STRAY_BYTES:,}) as U+FFFD: {', '.join(mended[:5])}{' ...' if len(mended) > 5 else ''}",
                          stacklevel=2)
        if not keys and cfg.jsonl_prompt_field and cfg.max_bytes and taken >= cfg.max_bytes:
            raise DataError(f"data.max_bytes={cfg.max_bytes:,} holds no whole prompt-and-answer document of "
                            f"{root}; raise data.max_bytes (or set it to 0, all of the corpus)")
        if not keys:
            jsonl = any(_format(cfg, path) == "jsonl" for _, path in files)
            fields = f"data.jsonl_field (now {cfg.jsonl_field!r}) to the field that holds the text" + (
                f" and data.jsonl_prompt_field (now {cfg.jsonl_prompt_field!r}) to the prompt's"
                if cfg.jsonl_prompt_field else "")
            raise DataError(f"data.source={cfg.source!r}: no non-empty UTF-8 documents in {root} "
                            f"({len(files)} file(s) looked at); point data.source at text data"
                            + (f", or set {fields}" if jsonl else ""))
        self.count, self.digest = len(keys), hashed.h.hexdigest()
        self.val = _val_flags(keys, sizes, cfg.val_fraction)
        self.val_count = sum(self.val)
        # the train split's hash: all documents' where none is val; the first pass's where the split is as drawn
        drawn = sum(k >= cfg.val_fraction for k in keys) == self.count - self.val_count
        self.train_digest = self.digest if not self.val_count else train.h.hexdigest() if drawn else None
        stopped = f", data.max_bytes={cfg.max_bytes:,} reached" if cfg.max_bytes and taken >= cfg.max_bytes else ""
        self.read = f"{self.count:,} document{'s' * (self.count != 1)} from {read:,} of {len(files):,} files in " \
                    f"{root}{stopped}"

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        return self.documents()

    def labelled(self):
        """(document, whether it is val) of each document again: read from the files, and checked, once all are
        read, to be the first pass's."""
        hashed, n = _DocsHash(), 0
        for kind, i, doc in _read(self.cfg, self.kept, warn=False):
            if kind == "bad":
                raise self._changed(f"{self.kept[i][1]} is no longer UTF-8 text")
            if kind == "doc":
                hashed.add(doc)
                yield doc, n < self.count and self.val[n]
                n += 1
        if (n, hashed.h.hexdigest()) != (self.count, self.digest):
            raise self._changed(f"{n:,} documents read again against {self.count:,} at first, or other text")

    def documents(self, val: bool | None = None):
        """The documents again (None), or those of one split (labelled)."""
        return (doc for doc, is_val in self.labelled() if val is None or bool(is_val) == val)

    def part(self, val: bool) -> _Part:
        return _Part(self, val)

    def _changed(self, what: str) -> DataError:
        return DataError(f"data.source={self.cfg.source!r} changed while it was read ({what}); leave its files as "
                         f"they are while sixfold reads them, then run again")


class _Part:
    """The train (val False) or val documents of a Corpus: its count, and a pass over them."""

    def __init__(self, corpus: Corpus, val: bool):
        self.corpus, self.val = corpus, val

    def __len__(self) -> int:
        return self.corpus.val_count if self.val else self.corpus.count - self.corpus.val_count

    def __iter__(self):
        return self.corpus.documents(self.val)


def iter_documents(cfg: DataConfig) -> list[tuple]:
    """(document id, text) of the corpus in a deterministic order, at most data.max_bytes of text if set (with
    data.jsonl_prompt_field, (id, text, prompt_chars))."""
    kind, root, files = _corpus(cfg)
    if kind == "bin":
        raise DataError(f"data.source={cfg.source!r} holds pre-tokenized .bin files, not documents")
    return list(Corpus(cfg, root, files))


def _val_key(doc_id: str) -> float:
    """A document's draw for the val split, in [0, 1): a stable hash of its id."""
    return int.from_bytes(hashlib.sha256(_encoded(doc_id)).digest()[:8], "big") / 2 ** 64


def _encoded(s: str) -> bytes:
    """A document's id or text in UTF-8; an id from a file name that is not UTF-8 as the file system gave it
    (Python's surrogateescape, as os.walk decodes it)."""
    return s.encode("utf-8", "surrogateescape")


def _val_flags(keys: list[float], sizes: list[int], val_fraction: float) -> bytearray:
    """Which documents (by their _val_key and characters) are val: about val_fraction of them (not all: one stays
    train). Where none falls to val, or those that do hold more than SPLIT_SLACK times val_fraction of the text (a
    corpus of few documents), none is: every document is train and its stream's last val_fraction of tokens is
    the val split, as for a single document. At val_fraction 0, none is."""
    none = bytearray(len(keys))
    if len(keys) == 1 or not val_fraction:
        return none
    flags = bytearray(k < val_fraction for k in keys)
    if all(flags):
        flags[max(range(len(keys)), key=keys.__getitem__)] = 0
    held = sum(n for n, v in zip(sizes, flags) if v)
    return none if not held or held > SPLIT_SLACK * val_fraction * sum(sizes) else flags


def split_documents(docs, val_fraction: float):
    """(train, val) lists of the documents (id, text, ...), as _val_flags draws them."""
    flags = _val_flags([_val_key(d[0]) for d in docs], [len(d[1]) for d in docs], val_fraction)
    return [d for d, v in zip(docs, flags) if not v], [d for d, v in zip(docs, flags) if v]
