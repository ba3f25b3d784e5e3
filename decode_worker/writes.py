"""A decode loop's writes to Redis: one call a step, its reply read after the next forward pass.

Each step's tokens and ends go to Redis in one command (`SyncStore.send`) whose reply is read
(`settle`) after the next forward pass: Redis applies them while the model runs. Writes of
others can ride along with it (`ride_along`): a colocated worker's first tokens and DECODING
moves go in the same call, before the step's own tokens (they were sampled first), so the model
thread waits for no round trip of theirs either.

Redis trouble loses no write: a step that could not be sent, or whose reply was lost with its
connection, is applied again through the store's client when it settles (the client rides an
outage for redis_outage_s, and Redis skips the tokens it already has); an outage longer than
that raises, and the model loop takes its process down.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pdq.state import redisconn
from pdq.state.calls import Call
from pdq.state.request import State
from pdq.state.store import Moved, Sent, StepItem, SyncStore

log = logging.getLogger("pdq.decode")

S = TypeVar("S")  # what the step's items belong to (the decode loop's sequences)


@dataclass
class RideAlong:
    """A write that goes to Redis with the next step (`StepWriter.ride_along`): step `items`
    (before the step's own), then DECODING-style `moves` (as `RequestStore.step_and_transition`
    takes them); `then(kept, moved)` gets their answers, on the model thread, once the reply is
    read."""

    items: list[StepItem]
    moves: list[tuple[str, int, State, dict[str, Any]]]
    then: Callable[[list[bool], list[Moved | bool]], None]


class StepWriter(Generic[S]):
    """`refused(owner)` is called, when a reply is read, for each step item's owner whose write
    Redis refused (its request ended elsewhere, or the attempt is stale): it is to leave. Every
    call runs on the model thread."""

    def __init__(self, store: SyncStore, refused: Callable[[S], None]):
        self.store = store
        self.refused = refused
        # the call sent last, its reply unread: (Sent, or None if it could not be sent; the owner
        # of each of the step's own items, None where it ended; the call; the writes riding along)
        self.sent: tuple[Sent | None, list[S | None], Call, list[RideAlong]] | None = None
        self._riders: list[RideAlong] = []  # to go with the next step

    def ride_along(self, rider: RideAlong) -> None:
        """Writes `rider` with the next step sent (or alone at `flush_riders`)."""
        self._riders.append(rider)

    def send(self, items: list[StepItem], owners: list[S | None]) -> None:
        """Sends a step's items (`owners`: each one's owner) with the writes riding along, in one
        call, whose reply is read at the next `settle` or `settle_sent` (a reply still unread is
        read first)."""
        self.settle_sent()
        riders, self._riders = self._riders, []
        if not items and not riders:
            return
        call = self._call(items, riders)
        self.sent = (self._send(call), owners, call, riders)

    def flush_riders(self) -> None:
        """Sends the writes waiting to ride along, alone (no step goes now); the reply of the
        call sent before them is read first (`send`)."""
        if self._riders:
            self.send([], [])

    def settle(self) -> None:
        """Reads the reply of the call sent last (`settle_sent`), then sends the writes waiting to
        ride along and reads theirs too: afterwards Redis has everything written so far."""
        self.settle_sent()
        if self._riders:
            self.flush_riders()
            self.settle_sent()

    def settle_sent(self) -> None:
        """Reads the reply of the call sent last: the writes that rode along get their answers,
        and the owners of the items Redis refused are told (`refused`)."""
        if self.sent is None:
            return
        sent, owners, call, riders = self.sent
        self.sent = None
        reply = None
        if sent is not None:
            try:
                reply = sent.result()
            except redisconn.UNAVAILABLE_ERRORS as exc:
                log.warning("reply of a decode step lost (%s); applying it again", exc)
        if reply is None:
            reply = self.store.run(call)
        kept, moved = reply if riders else (reply, [])
        n = m = 0
        for rider in riders:
            rider.then(kept[n:n + len(rider.items)], moved[m:m + len(rider.moves)])
            n, m = n + len(rider.items), m + len(rider.moves)
        kept = kept[n:]
        if all(kept):  # most steps: Redis kept every sequence
            return
        for owner, ok in zip(owners, kept):
            if not ok and owner is not None:
                self.refused(owner)

    def _call(self, items: list[StepItem], riders: list[RideAlong]) -> Call:
        store: Any = type(self.store)
        if not riders:
            return store.step.build(self.store, items)
        return store.step_and_transition.build(self.store, [it for r in riders for it in r.items] + items,
                                               [mv for r in riders for mv in r.moves])

    def _send(self, call: Call) -> Sent | None:
        """-> None when it could not be sent (its connection broke): `settle_sent` applies it
        through the store's client."""
        try:
            return self.store.send(call)
        except redisconn.UNAVAILABLE_ERRORS as exc:
            log.warning("could not send a decode step (%s); it is applied when it settles", exc)
            return None
