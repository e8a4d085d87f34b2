"""One run at a time in a run directory: its rank 0 holds an exclusive lock on RUN_DIR/.lock while it runs (the
system lets go of it when the process ends, however it ends)."""
from __future__ import annotations

import fcntl
import os
import socket
import time
import warnings
from pathlib import Path

from .config import ConfigError

LOCK = ".lock"


def _in_use(run_dir: Path, fd: int) -> ConfigError:
    holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
    return ConfigError(f"log.run_dir={run_dir} is in use by another run (it holds {run_dir / LOCK}, which names host "
                       f"and process {holder}, the last run that could write it): wait for it to end, stop it, or set "
                       f"another log.run_dir")


def _lock(fd: int, kind: int, tries: int = 10) -> None:
    """flock without blocking, tried again for a second: another launch's momentary check may hold it."""
    for attempt in range(tries):
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if attempt == tries - 1:
                raise
            time.sleep(0.1)


def _open(path: Path) -> tuple[int, bool]:
    """The lock file, made as the umask allows (a group's shared directory: its members' too), and whether it could
    be opened for writing: another user's lock file is locked read-only (flock needs no more)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o666), True
    except PermissionError:
        pass
    except OSError as e:
        raise ConfigError(f"cannot open {path} ({e.strerror or e}), which keeps a second run out of "
                          f"{path.parent}: set log.run_dir to another directory") from None
    try:
        return os.open(path, os.O_RDONLY), False
    except OSError as e:
        raise ConfigError(f"cannot open {path} ({e.strerror or e}), which keeps a second run out of {path.parent}: "
                          f"make it readable and writable, remove it (no run is using the directory), or set "
                          f"log.run_dir to another directory") from None


class RunLock:
    """Held from __enter__ to __exit__; __enter__ refuses a directory another run holds."""

    def __init__(self, run_dir: str | Path):
        self.run_dir, self.fd = Path(run_dir), None

    def __enter__(self) -> RunLock:
        fd, writable = _open(self.run_dir / LOCK)
        try:
            _lock(fd, fcntl.LOCK_EX)
        except BlockingIOError:
            error = _in_use(self.run_dir, fd)
            os.close(fd)
            raise error from None
        except OSError as e:  # a file system without locks: runs there are not told apart
            os.close(fd)
            warnings.warn(f"{self.run_dir / LOCK} cannot be locked ({e.strerror or e}): nothing stops a second run "
                          f"from using {self.run_dir} at the same time")
            return self
        if writable:  # (who holds it, for the message of a run refused)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{socket.gethostname()} {os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def check_free(run_dir: str | Path) -> None:
    """Refuse a run directory another run holds, before any process starts (a shared lock, let go at once)."""
    path = Path(run_dir) / LOCK
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # none yet, or unreadable: RunLock decides
        return
    try:
        _lock(fd, fcntl.LOCK_SH)
    except BlockingIOError:
        raise _in_use(Path(run_dir), fd) from None
    except OSError:
        pass  # no locks here: RunLock says so
    finally:
        os.close(fd)
