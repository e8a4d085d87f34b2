"""When a rank can let go of what it sent. A send is known received once a message arrives that its peer sent
after the compute that used the data (that compute waited for it). The runtime then waits for the send, which
returns at once, and drops it; a send never known received is waited for at the step's end. The planner counts
the tensors a rank's sends keep alive from the same lists."""
from __future__ import annotations

import itertools
from collections import defaultdict

from .schedules import B, COMPUTE, F, RECV_B, RECV_F, SEND_B, SEND_F, Action, Schedule

SENDS = (SEND_F, SEND_B)


def _receipt(send: Action) -> Action:
    """The RECV that receives a SEND."""
    if send.kind == SEND_F:
        return Action(RECV_F, send.stage + 1, send.micro)
    return Action(RECV_B, send.stage - 1, send.micro)


def _waiting(recv: Action) -> Action:
    """The compute that waits for a RECV's data."""
    return Action(F if recv.kind == RECV_F else B, recv.stage, recv.micro)


def delivered(schedule: Schedule, rank: int) -> dict[Action, list[Action]]:
    """A RECV on `rank` -> the rank's sends known received once its data has arrived: for each send, of the
    messages its peer sends to this rank after using its data, the one this rank waits for first."""
    mine = schedule.ranks[rank]
    order = {a: i for i, a in enumerate(mine)}
    sends = _sends(mine)
    first = {peer: _first_replies(schedule, peer, rank, order) for peer in set(map(schedule.peer, sends))}
    out = defaultdict(list)
    for send in sends:
        at, reply = first[schedule.peer(send)]
        found = reply[at[_waiting(_receipt(send))] + 1]  # after the compute that used its data
        if found is not None:
            out[found].append(send)
    return dict(out)


def _sends(actions) -> list[Action]:
    return [a for a in actions if a.kind in SENDS]


def _first_replies(schedule: Schedule, peer: int, rank: int, order: dict[Action, int]):
    """`peer`'s action -> its position, and for each position the RECV on `rank` of the messages `peer` sends
    from there on that `rank` waits for first (None if none)."""
    theirs = schedule.ranks[peer]
    reply: list[Action | None] = [None] * (len(theirs) + 1)
    for i in range(len(theirs) - 1, -1, -1):
        reply[i] = reply[i + 1]
        a = theirs[i]
        if a.kind in SENDS and schedule.peer(a) == rank:
            r = _receipt(a)
            if reply[i] is None or order[_waiting(r)] <= order[_waiting(reply[i])]:
                reply[i] = r
    return {a: i for i, a in enumerate(theirs)}, reply


def held_sends(schedule: Schedule, rank: int) -> int:
    """The most hidden-state tensors a rank's sends keep alive during one of its computes: an F's output from that
    F until its B and its delivery, a B's input gradient from that B until its delivery. A tensor is counted from
    the compute after the one that made it: the peak of a compute is its own."""
    mine = schedule.ranks[rank]
    at = {a: i for i, a in enumerate(a for a in mine if a.kind in COMPUTE)}
    known = {send: at[_waiting(recv)] for recv, sends in delivered(schedule, rank).items() for send in sends}
    alive = [0] * (len(at) + 1)  # held at compute i: the running sum of these
    for send in _sends(mine):
        made = at[Action(F if send.kind == SEND_F else B, send.stage, send.micro)]
        end = known.get(send, len(at))
        if send.kind == SEND_F:  # the output is its backward's root
            end = max(end, at[Action(B, send.stage, send.micro)] + 1)
        if made + 1 < end:
            alive[made + 1] += 1
            alive[end] -= 1
    return max(itertools.accumulate(alive[:-1]), default=0)
