"""Which ranks to look at when a collective fails. Every rank writes its machine and process id into the job's
store when it joins; a rank whose collective fails writes that it did, then reads for a while which of the group's
other ranks failed too. Those that did not died, hang, or were still busy elsewhere: the failure's message names
them, and the collectives that the others failed in where those differ."""
from __future__ import annotations

import os
import socket
import threading
import time

GRACE_S = 10.0  # how long a failed rank waits for the group's others to fail too (at most parallel.timeout_s)
NAMED = 8  # ranks named in a message; more are counted


class RollCall:
    def __init__(self, store, rank: int, timeout_s: float):
        """The job's store (this start's keys), this rank, parallel.timeout_s; writes this rank's machine and pid."""
        self.store, self.rank, self.timeout_s, self.grace = store, rank, timeout_s, min(GRACE_S, timeout_s)
        self.failures = 0  # this rank's failures so far: each is written under its own key
        self.read: dict[int, int] = {}  # per other rank, its first failure not yet read here: each counts once
        store.set(f"rollcall/host/{rank}", f"{socket.gethostname()}, pid {os.getpid()}")

    def absent(self, name: str, ranks) -> str:
        """After `name` over `ranks` failed here: sentences naming the group's ranks that did not fail with it and
        the other collectives that others failed in. Bounded in time: a store that does not answer (its host is the
        one that hangs) is said so."""
        ranks = list(ranks)
        if self.rank not in ranks or len(ranks) < 2:
            return ""
        said: list[str] = []

        def call() -> None:
            try:
                said.append(self._call(name, ranks))
            except Exception as e:  # DistNetworkError: the store's host is gone
                said.append(f" The job's store failed too ({e}): its host (rank 0's machine, or torchrun's agent) "
                            "may be the one that died.")

        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        thread.join(self.grace + 5)
        return said[0] if said else (" The job's store did not answer either: its host (rank 0's machine, or "
                                     "torchrun's agent) may be the one that hangs.")

    def _call(self, name: str, ranks: list[int]) -> str:
        began = time.time()
        self.store.set(f"rollcall/failed/{self.rank}/{self.failures}", f"{began} {name}")
        self.failures += 1
        failed, deadline = {}, time.monotonic() + self.grace
        while True:
            for r in ranks:
                if r != self.rank and r not in failed:
                    self._take(r, began, failed)
            if len(failed) == len(ranks) - 1 or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        missing = [r for r in ranks if r != self.rank and r not in failed]
        elsewhere = [f"rank {r} in {what}" for r, what in sorted(failed.items()) if what != name]
        said = ""
        if missing:
            named = ", ".join(f"{r} ({self._host(r)})" for r in missing[:NAMED])
            more = f" and {len(missing) - NAMED} more" if len(missing) > NAMED else ""
            one = len(missing) == 1
            said += (f" Rank{'' if one else 's'} {named}{more} did not fail with it within {self.grace:g} s: "
                     f"{'it' if one else 'one of them'} died, hangs, or is busy elsewhere for longer than "
                     f"parallel.timeout_s{'' if one else ', or waits on such a rank'}.")
        if elsewhere:
            said += f" Failed in other collectives: {', '.join(elsewhere[:NAMED])}."
        return said

    def _take(self, r: int, began: float, failed: dict[int, str]) -> None:
        """Rank r's next failure not read here, into `failed`, where it is this one's: a group's ranks fail up to
        parallel.timeout_s apart (by the machines' clocks, taken to agree within seconds); older ones are passed."""
        while True:
            key = f"rollcall/failed/{r}/{self.read.get(r, 0)}"
            if not self.store.check([key]):
                return
            when, what = self.store.get(key).decode().split(" ", 1)
            self.read[r] = self.read.get(r, 0) + 1
            if float(when) > began - self.timeout_s - self.grace:
                failed[r] = what
                return

    def _host(self, rank: int) -> str:
        key = f"rollcall/host/{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else "machine unknown"
