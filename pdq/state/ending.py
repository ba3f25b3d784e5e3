"""How a request ends: every path, and how each reaches the one writer of terminal states.

A request ends exactly once. The Lua function `finish` (`pdq/lua/lib.lua`) is the only code
that writes a terminal state: it records the state, closes the output stream with its end entry,
frees the queue entry, leases, deadline and held sets, settles the tenant's charge, sets expiry
and (unless a worker ends its own attempt in its step) tells the workers on the cancel channel.
Every script that calls it first checks that the request has not ended, in the same atomic
script, so a second ender (or a replay) finds it ended and changes nothing.

Enders outside a worker's step call `RequestStore.end(rid, Ending, epoch=None)` (script FINISH):
- a client's cancel: Generation.Cancel -> gateway -> Scheduler.Cancel -> `Ending.cancelled("client")`;
- a client that went away: the gateway's cancel-on-exit -> Scheduler.Cancel ->
  `Ending.cancelled("client disconnected")`; its call deadline passed: `Ending.timed_out()`;
- an operator: Operator.CancelRequest -> Scheduler.Cancel -> `Ending.cancelled("operator")`;
  Operator.CancelTenant -> `RequestStore.end_tenant(tenant, Ending.cancelled("operator"))`
  (script CANCEL_TENANT: `finish` for each live request of the tenant);
- a worker ending its attempt outside a step (epoch-fenced): a prefill worker whose request's
  deadline passed during prefill -> `Ending.timed_out("during prefill")`.
Enders inside Lua:
- a worker's step (script STEP): the request's normal end (COMPLETED: length, eos, stop) or the
  end its worker saw (TIMED_OUT at its deadline), with its last tokens, epoch-fenced;
- the scheduler's janitor (script EXPIRE_DEADLINES): TIMED_OUT, live requests past their deadline;
- a given-back attempt whose bound is reached (REQUEUE, REAP_WORKER, EXPIRE_LEASES, see
  `RequestStore.requeue`): FAILED, with the last attempt's error.
"""

from dataclasses import dataclass

from pdq.state.request import State

# Kinds of a given-back attempt (`RequestStore.requeue`): the request's own failure (a failed
# hand-off, an error running it on a worker) or an attempt lost to infrastructure (its worker
# died, shut down or lost Redis; its prefill lease expired). Only failures count towards
# max_attempts; losses are bounded by `pdq.state.store.RetryLimits.max_lost`. A preempted attempt (a decode
# worker made room for a better tier's request) counts towards neither.
FAILURE = "failure"
LOST = "lost"
PREEMPTED = "preempted"
KINDS = (FAILURE, LOST, PREEMPTED)


@dataclass(frozen=True)
class Ending:
    """A terminal state, its finish reason (`pdq.state.request.FINISH_REASONS`) and the error shown."""

    state: State
    reason: str
    error: str = ""

    def __post_init__(self) -> None:
        if not self.state.terminal:
            raise ValueError(f"{self.state.value} is not a terminal state")

    @classmethod
    def cancelled(cls, by: str = "client") -> "Ending":
        return cls(State.CANCELLED, "cancelled", f"cancelled by {by}")

    @classmethod
    def timed_out(cls, where: str = "") -> "Ending":
        return cls(State.TIMED_OUT, "timeout", "deadline exceeded" + (f" {where}" if where else ""))

    @classmethod
    def failed(cls, error: str) -> "Ending":
        return cls(State.FAILED, "error", error)
