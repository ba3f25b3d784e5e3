"""The checker: pure functions of the plan, what the load recorded (`record.Outcome`), what Redis
holds after the run (`snapshot.Snapshot`) and the fault-free reference. Each check returns the
violations it found, each naming its requests and the evidence.

- ends_exactly_once: an ended request has one terminal state, and its output stream exactly one
  end entry, the last, saying that state; a live one has none; the client learned that end
- lost: every request a client got an id for ended (drained before the snapshot)
- duplicated: one client id, one request; no request nobody asked for
- garbled: greedy tokens, in Redis and as clients saw them, are the reference's (a prefix of
  them for a request that ended early); a COMPLETED request has all max_tokens of them
- stream_indices: indices without gaps or repeats, on the client across resumes and in Redis
- unrequested_cancel / unrequested_timeout: CANCELLED only if the load cancelled it; TIMED_OUT
  only at or after its deadline, as last moved (the record's deadline_ms)
- unknown_internal: no call answered UNKNOWN or INTERNAL; unexpected_status: nor a status its
  situation does not explain (e.g. NOT_FOUND for a request the client was given)
- stall: progress throughout, nothing given up on
- leaks: queues, counters, leases, held sets and deadlines empty; every KV slot free
- failed: no request FAILED (the fault schedule always leaves a healthy worker of each role)
- process_exits / heal: no process exited unasked; the cluster came back after every fault
- thread_deaths: no thread of any role died ("Exception in thread" in its log): every loop
  survives its dependencies failing, or takes its process down
"""

import re

from dataclasses import dataclass, field

from pdq.state import request
from pdq.chaos.plan import RequestPlan
from pdq.chaos.record import Outcome
from pdq.chaos.snapshot import Leftovers, Snapshot

TERMINAL = {state.value for state in request.TERMINAL}
CHECKS = ("ends_exactly_once", "lost", "duplicated", "garbled", "stream_indices", "unrequested_cancel",
          "unrequested_timeout", "unknown_internal", "unexpected_status", "stall", "leaks", "failed",
          "process_exits", "heal", "thread_deaths")
# A TIMED_OUT request must have ended at or after its deadline; this much earlier is clock noise.
DEADLINE_SLACK_MS = 500
# How a stream's end maps to the request's state (other ends, e.g. UNAVAILABLE, say nothing of it).
STREAM_END_STATE = {"LENGTH": "COMPLETED", "EOS": "COMPLETED", "STOP": "COMPLETED", "CANCELLED": "CANCELLED",
                    "DEADLINE_EXCEEDED": "TIMED_OUT"}
# Statuses a call may answer under faults, by method, besides OK and the bugs UNKNOWN/INTERNAL.
ALLOWED = {
    "Submit": {"UNAVAILABLE", "RESOURCE_EXHAUSTED"},
    "GenerateStream": {"UNAVAILABLE", "RESOURCE_EXHAUSTED", "CANCELLED", "DEADLINE_EXCEEDED"},
    "StreamResult": {"UNAVAILABLE", "CANCELLED", "DEADLINE_EXCEEDED"},
    "GetResult": {"UNAVAILABLE"},
    "Cancel": {"UNAVAILABLE"},
    "SetDeadline": {"UNAVAILABLE", "FAILED_PRECONDITION"},
}


@dataclass
class Violation:
    check: str
    message: str
    requests: list[str] = field(default_factory=list)  # client ids (or request ids nobody asked for)
    evidence: dict = field(default_factory=dict)


def record_tokens(entries: list[dict]) -> tuple[list[int], list[list[int]]]:
    """(token ids, [first index, tokens] per token entry) of an output stream's entries, in order."""
    tokens, runs = [], []
    for e in entries:
        if "i" in e:
            ids = [int(t) for t in e.get("t", "").split(",") if t]
            runs.append([int(e["i"]), len(ids)])
            tokens.extend(ids)
    return tokens, runs


def index_break(runs: list[list[int]]) -> str:
    """Where [first index, tokens] runs stop following each other from index 0 ("" = nowhere)."""
    at = 0
    for index, n in runs:
        if index != at:
            return f"{'repeat' if index < at else 'gap'}: index {index} after {at} tokens"
        at = index + n
    return ""


def _v(check: str, plan: RequestPlan, out: Outcome, message: str, **evidence) -> Violation:
    return Violation(check, message, [plan.client_id], {"request_id": out.rid, **evidence})


def check_request(plan: RequestPlan, out: Outcome, snap: Snapshot, reference: list[int]) -> list[Violation]:
    """Every per-request check of one request. reference: the prompt's greedy tokens (at least
    plan.max_tokens of them)."""
    found = []
    rec = snap.records.get(out.rid, {}) if out.rid else {}
    state = rec.get("state", "")
    entries = snap.outputs.get(out.rid, []) if out.rid else []
    summary = {"kind": plan.kind, "state": state, "error": rec.get("error", ""), "attempts": rec.get("attempts", "")}

    # lost
    if out.not_accepted:
        mapped = snap.idem.get(plan.client_id)
        found.append(_v("lost", plan, out, f"accepted as {mapped}, but no call returned its id" if mapped
                        else "never accepted", last_error=out.not_accepted))
    elif out.rid and not rec:
        found.append(_v("lost", plan, out, "its record is gone", **summary))
    elif out.rid and state not in TERMINAL:
        found.append(_v("lost", plan, out, f"not ended after the drain: {state}", **summary))

    # ends exactly once
    ends = [e for e in entries if "done" in e]
    if state in TERMINAL:
        if len(ends) != 1:
            found.append(_v("ends_exactly_once", plan, out, f"{len(ends)} end entries in its output stream",
                            ends=ends, **summary))
        elif entries[-1] is not ends[0]:
            found.append(_v("ends_exactly_once", plan, out, "output entries after its end entry", **summary))
        elif ends[0]["done"] != state:
            found.append(_v("ends_exactly_once", plan, out, f"end entry says {ends[0]['done']}, record {state}",
                            **summary))
        if out.end_state and out.end_state != state:
            found.append(_v("ends_exactly_once", plan, out, f"the client learned {out.end_state}, record {state}",
                            **summary))
        want = STREAM_END_STATE.get(out.stream_end)
        if want and want != state and not (out.stream_end == "CANCELLED" and out.cancelled == "disconnect"):
            found.append(_v("ends_exactly_once", plan, out, f"its stream ended {out.stream_end}, record {state}",
                            **summary))
    elif ends:
        found.append(_v("ends_exactly_once", plan, out,
                        f"{len(ends)} end entries, but the record says {state or 'nothing'}", ends=ends))

    # duplicated
    if len(out.rids) > 1:
        found.append(_v("duplicated", plan, out, f"one client id, {len(out.rids)} requests", request_ids=out.rids))
    if sum(out.created) > (0 if plan.kind == "stream" else 1):  # a stream's GenerateStream created it
        found.append(_v("duplicated", plan, out, f"Submit created it {sum(out.created)} time(s)"
                        + (" after GenerateStream did" if plan.kind == "stream" else ""), created=out.created))
    if out.echoed_id and out.echoed_id != plan.client_id:
        found.append(_v("duplicated", plan, out, f"GetResult says it was submitted as {out.echoed_id!r}"))
    mapped = snap.idem.get(plan.client_id)
    if out.rid and mapped and mapped != out.rid:
        found.append(_v("duplicated", plan, out, f"client id maps to {mapped} in Redis", mapped=mapped))

    # garbled, stream indices (Redis side)
    if entries:
        tokens, runs = record_tokens(entries)
        ref = reference[:plan.max_tokens]
        broken = index_break(runs)
        if broken:
            found.append(_v("stream_indices", plan, out, f"in its output stream, {broken}", runs=runs))
        if tokens != ref[:len(tokens)] or len(tokens) > plan.max_tokens:
            found.append(_v("garbled", plan, out,
                            f"tokens in Redis differ from the reference at {_diverge(tokens, ref)}",
                            tokens=tokens, reference=ref, **summary))
        if rec and int(rec.get("n_out") or 0) != len(tokens):
            found.append(_v("garbled", plan, out, f"n_out {rec.get('n_out')} but {len(tokens)} tokens in its stream"))
        if state == "COMPLETED" and (len(tokens) != plan.max_tokens or rec.get("finish_reason") != "length"):
            found.append(_v("garbled", plan, out, f"COMPLETED with {len(tokens)} of {plan.max_tokens} tokens "
                            f"({rec.get('finish_reason')})"))
        if out.tokens and out.tokens != tokens[:len(out.tokens)]:
            found.append(_v("garbled", plan, out,
                            f"streamed tokens differ from Redis's at {_diverge(out.tokens, tokens)}",
                            streamed=out.tokens, stored=tokens))
        if out.end_state and out.end_tokens != tokens:
            found.append(_v("garbled", plan, out, "GetResult's tokens differ from Redis's",
                            got=out.end_tokens, stored=tokens))
    elif state == "COMPLETED":
        found.append(_v("garbled", plan, out, "COMPLETED without an output stream"))
    if out.stream_end in ("LENGTH", "EOS", "STOP") and out.tokens != reference[:plan.max_tokens]:
        found.append(_v("garbled", plan, out, "its stream finished, but it did not stream the reference's tokens",
                        streamed=out.tokens, reference=reference[:plan.max_tokens]))

    # stream indices (client side, across resumes)
    broken = index_break(out.messages)
    if broken:
        found.append(_v("stream_indices", plan, out, f"streamed to the client, {broken}", messages=out.messages,
                        resumes=out.resumes))

    # unrequested ends
    if state == "CANCELLED" and not out.cancelled:
        found.append(_v("unrequested_cancel", plan, out, "CANCELLED, but the load never cancelled it", **summary,
                        finished_ms=rec.get("finished_ms"), calls=[c.__dict__ for c in out.calls]))
    if state == "TIMED_OUT":
        deadline, finished = int(rec.get("deadline_ms") or 0), int(rec.get("finished_ms") or 0)
        timing = dict(created_ms=rec.get("created_ms"), deadline_ms=deadline, finished_ms=finished,
                      timeout_ms=plan.timeout_ms, moves=[m.__dict__ for m in out.moves], **summary)
        if not deadline:
            found.append(_v("unrequested_timeout", plan, out, "TIMED_OUT without a deadline", **timing))
        elif finished < deadline - DEADLINE_SLACK_MS:
            found.append(_v("unrequested_timeout", plan, out,
                            f"TIMED_OUT {deadline - finished} ms before its deadline (as last moved)", **timing))

    # statuses
    for c in out.calls:
        if c.code in ("UNKNOWN", "INTERNAL"):
            found.append(_v("unknown_internal", plan, out, f"{c.method} answered {c.code}: {c.details}", t=c.t))
        elif not c.ours and c.code not in ALLOWED.get(c.method, ()):
            found.append(_v("unexpected_status", plan, out, f"{c.method} answered {c.code}: {c.details}", t=c.t))

    if out.abandoned:
        found.append(_v("stall", plan, out, f"given up: {out.abandoned}", **summary))
    if state == "FAILED":
        found.append(_v("failed", plan, out, f"FAILED after {rec.get('attempts')} attempt(s): {rec.get('error')}",
                        **summary))
    return found


def _diverge(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_unasked(plans: list[RequestPlan], outcomes: list[Outcome], snap: Snapshot) -> list[Violation]:
    """Requests in Redis that no client id of the load maps to: a second generation."""
    known = {r for out in outcomes for r in out.rids} | set(snap.idem.values())
    extra = sorted(set(snap.index) - known)
    if not extra:
        return []
    return [Violation("duplicated", f"{len(extra)} request(s) in Redis that no client id maps to", extra,
                      {rid: {k: snap.records.get(rid, {}).get(k) for k in ("state", "error", "created_ms")}
                       for rid in extra[:20]})]


def check_leaks(left: Leftovers, decode_workers: int, heartbeat_s: float = 0.5) -> list[Violation]:
    """What must be empty or zero once every request ended (p:load's fields, KV slots)."""
    found = []

    def leak(what: str, evidence) -> None:
        found.append(Violation("leaks", what, [], {"found": evidence}))

    for name, items in (("queue", left.queues), ("backlog", left.backlogs), ("held set", left.held),
                        ("live set", left.live)):
        for key, members in items.items():
            if members:
                leak(f"{name} {key} holds {len(members)}", members[:20])
    for key, fields in [(k, v) for k, v in left.depth.items()] + [("load", left.load)]:
        nonzero = {f: v for f, v in fields.items() if float(v or 0) != 0}
        if nonzero:
            leak(f"counters of {key} are not zero", nonzero)
    if left.leases:
        leak(f"p:leases holds {len(left.leases)}", left.leases[:20])
    if left.deadlines:
        leak(f"p:deadlines holds {len(left.deadlines)}", dict(list(left.deadlines.items())[:20]))
    fresh = {wid: w for wid, w in left.decode_workers.items()
             if left.now_ms - int(w.get("heartbeat_ms") or 0) <= max(3000, 6 * heartbeat_s * 1000)}
    if len(fresh) < decode_workers:
        leak(f"{len(fresh)} of {decode_workers} decode workers heartbeating", sorted(left.decode_workers))
    for wid, w in fresh.items():
        if ((w.get("reserved") or "0") != "0" or (w.get("running") or "0") != "0"
                or w.get("kv_free_tokens") != w.get("kv_total_tokens")):
            leak(f"decode worker {wid}: {w.get('reserved')} seats held, {w.get('running')} running, "
                 f"{w.get('kv_free_tokens')} of {w.get('kv_total_tokens')} KV tokens free", w)
    return found


EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b")  # a traceback's last line


def check_logs(logs: dict[str, str]) -> list[Violation]:
    """A thread that died of an exception, in any role's log (its traceback's last line as evidence)."""
    found = []
    for name, text in sorted(logs.items()):
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("Exception in thread"):
                end = next((lines[j] for j in range(i + 1, len(lines)) if EXCEPTION_LINE.match(lines[j])), "")
                found.append(Violation("thread_deaths", f"{name}: {line.rstrip(':')}: {end}", [], {"log_line": i + 1}))
    return found


def check_run(plans: list[RequestPlan], outcomes: list[Outcome], snap: Snapshot, references: list[list[int]],
              stalls: list[dict], exits: list, unhealed: list[str], decode_workers: int,
              logs: dict[str, str] | None = None) -> list[Violation]:
    """Every check. references: per prompt index, its greedy tokens; logs: each role's log."""
    found = []
    for plan, out in zip(plans, outcomes):
        found += check_request(plan, out, snap, references[plan.prompt])
    found += check_unasked(plans, outcomes, snap)
    found += [Violation("stall", f"no progress from t={s['from']}s to t={s['to']}s with {s['outstanding']} "
                                 f"request(s) outstanding" + (" (the run gave up)" if s.get("aborted") else ""),
                        s.get("requests", []), s) for s in stalls]
    found += check_leaks(snap.state, decode_workers) if snap.state is not None else []
    found += [Violation("process_exits", f"{e.name} exited with status {e.code} at t={e.t}s, unasked (restarted)",
                        [], {"log_tail": e.log_tail}) for e in exits]
    found += [Violation("heal", u) for u in unhealed]
    found += check_logs(logs or {})
    return found
