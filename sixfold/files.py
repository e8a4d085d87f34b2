"""Files written whole or not at all: a temporary name beside the file, moved onto it once complete."""
from __future__ import annotations

import os
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def written(path: Path):
    """A temporary name beside `path`, moved onto it once the block completes; removed if the block stops part-way
    (an error, a signal, a lost peer), so that no half-written file is left."""
    if (real := Path(os.path.realpath(path))).parent.is_dir():  # a link's file is replaced, the link kept
        path = real
    tmp = path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")  # several machines may write it
    try:
        yield tmp
        try:
            if path.is_file():
                shutil.copymode(path, tmp)  # as the file had it, not as the umask gives a new one
            os.replace(tmp, path)
        except OSError as e:  # named by the file it was for, not the temporary one
            raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> None:
    """`text` into `path`, whole or not at all."""
    with written(path) as tmp:
        tmp.write_text(text)
