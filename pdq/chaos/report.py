"""The result of a chaos run: a JSON document (everything, every violation with its evidence)
and a human summary (counts, faults, latencies, each check with its first violations)."""

import dataclasses
import json
import math
import re
from collections import Counter
from pathlib import Path

from pdq.chaos.check import CHECKS, Violation
from pdq.chaos.options import ChaosOptions
from pdq.chaos.plan import RequestPlan
from pdq.chaos.record import Outcome
from pdq.chaos.snapshot import Snapshot

SHOWN = 5  # violations per check in the human summary


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def cancelled_in(rec: dict, seen: str = "") -> str:
    """The phase a CANCELLED request was cancelled in: the state the load saw just before it
    cancelled, else what its record's timestamps say."""
    if rec.get("state") != "CANCELLED":
        return f"after its end ({rec.get('state') or 'unknown'})"
    if seen in ("QUEUED", "PREFILLING", "TRANSFERRING", "DECODING"):
        return {"QUEUED": "queued", "DECODING": "decode"}.get(seen, "prefill")
    if not rec.get("dispatched_ms"):
        return "queued"
    if not rec.get("first_token_ms"):
        return "prefill"
    return "decode"


def build(opts: ChaosOptions, plans: list[RequestPlan], outcomes: list[Outcome], snap: Snapshot,
          struck: list, statuses: Counter, violations: list[Violation], load_s: float, wall_s: float,
          out_dir: Path, exits: list, logs: dict[str, str] | None = None) -> dict:
    records = {o.index: snap.records.get(o.rid, {}) for o in outcomes if o.rid}
    by_state = Counter(records[o.index].get("state", "MISSING") if o.rid else "NOT_ACCEPTED" for o in outcomes)
    asked = [o for o in outcomes if o.cancelled in ("rpc", "disconnect")]
    done = [o for o in outcomes if o.rid and records[o.index].get("state") == "COMPLETED" and o.t_end]
    per_check = Counter(v.check for v in violations)
    return {
        "ok": not violations,
        "options": dataclasses.asdict(opts),
        "load_s": round(load_s, 1),
        "wall_s": round(wall_s, 1),
        "requests": {
            "planned": len(plans),
            "accepted": sum(1 for o in outcomes if o.rid),
            "by_state": dict(sorted(by_state.items())),
            "by_kind": dict(Counter(p.kind for p in plans)),
            "deadlines": dict(Counter(p.deadline for p in plans)),
            "duplicate_submits": sum(p.duplicate for p in plans),
            "stream_resumes": sum(o.resumes for o in outcomes),
            "cancels": {"asked": len(asked), "by_how": dict(Counter(o.cancelled for o in asked)),
                        "in_state": dict(Counter(cancelled_in(records.get(o.index, {}), o.cancel_state)
                                                 for o in asked))},
            "given_up": sum(1 for o in outcomes if o.abandoned),
            "attempts": dict(sorted(Counter(int(r.get("attempts") or 0) for r in records.values()).items())),
        },
        "latency_ms": {
            "e2e_p50": round(1000 * percentile([o.t_end - o.t_start for o in done], 50), 1),
            "e2e_p99": round(1000 * percentile([o.t_end - o.t_start for o in done], 99), 1),
            "ttft_p50": round(1000 * percentile([o.t_first_token - o.t_start for o in done if o.t_first_token], 50), 1),
            "ttft_p99": round(1000 * percentile([o.t_first_token - o.t_start for o in done if o.t_first_token], 99), 1),
        },
        "faults": {"by_kind": dict(Counter(s.kind for s in struck)), "struck": [dataclasses.asdict(s) for s in struck],
                   "scheduler_takeover_s": _spread([s.took_over_s for s in struck if s.took_over_s])},
        "submits_refused": sum(n for (m, c), n in statuses.items() if m == "Submit" and c != "OK"),
        "process_exits": [dataclasses.asdict(e) for e in exits],
        "log_errors": log_errors(logs or {}),
        "statuses": {f"{m} {c}": n for (m, c), n in sorted(statuses.items())},
        "checks": {c: {"ok": not per_check[c], "violations": per_check[c]} for c in CHECKS},
        "violations": [dataclasses.asdict(v) for v in violations],
        "out": str(out_dir),
    }


def _spread(values: list[float]) -> dict:
    """{n, median, max} of a few durations ({n: 0} when none)."""
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": round(percentile(values, 50), 2), "max": round(max(values), 2)}


LOG_LEVEL = re.compile(r" (ERROR|CRITICAL) (\S+): (.*)")
IDS = re.compile(r"[0-9a-f]{32}|\d+(\.\d+)?")


def log_errors(logs: dict[str, str]) -> dict:
    """Per role, its ERROR and CRITICAL log lines by message (ids and numbers blanked), most first:
    not violations by themselves (a failure logged and handled), but where to look."""
    out = {}
    for name, text in sorted(logs.items()):
        seen = Counter(f"{m.group(1)} {m.group(2)}: {IDS.sub('N', m.group(3))[:160]}"
                       for m in map(LOG_LEVEL.search, text.splitlines()) if m)
        if seen:
            out[name] = dict(seen.most_common(10))
    return out


def write(result: dict, path: Path) -> None:
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")


def write_outcomes(plans: list[RequestPlan], outcomes: list[Outcome], snap: Snapshot, path: Path) -> None:
    """One JSON line per request: its plan, what the load saw, and its record in Redis."""
    with path.open("w") as f:
        for plan, out in zip(plans, outcomes):
            f.write(json.dumps({"plan": dataclasses.asdict(plan), "outcome": dataclasses.asdict(out),
                                "record": snap.records.get(out.rid, {})}, default=str) + "\n")


def summary(result: dict, violations: list[Violation]) -> str:
    r, lat = result["requests"], result["latency_ms"]
    lines = [f"pdq chaos: {'OK' if result['ok'] else 'FAILED'}: {len(violations)} violation(s); "
             f"load {result['load_s']:.0f}s, wall {result['wall_s']:.0f}s",
             f"requests: {r['planned']} planned, {r['accepted']} accepted; "
             + ", ".join(f"{k} {v}" for k, v in r["by_state"].items()),
             f"  kinds: {_pairs(r['by_kind'])}; deadlines: {_pairs(r['deadlines'])}; "
             f"duplicate submits {r['duplicate_submits']}; stream resumes {r['stream_resumes']}; "
             f"given up {r['given_up']}; attempts: {_pairs(r['attempts'])}",
             f"  cancels: {r['cancels']['asked']} ({_pairs(r['cancels']['by_how'])}), "
             f"cancelled in: {_pairs(r['cancels']['in_state'])}",
             f"faults: {_pairs(result['faults']['by_kind']) or 'none'}; requests in flight when they struck: "
             f"{_in_flight(result['faults']['struck'])}",
             f"latency of COMPLETED requests (client side): e2e p50 {lat['e2e_p50']:.0f} ms, "
             f"p99 {lat['e2e_p99']:.0f} ms; TTFT p50 {lat['ttft_p50']:.0f} ms, p99 {lat['ttft_p99']:.0f} ms",
             "logged errors: " + ("; ".join(f"{role}: {sum(c.values())}" for role, c in result["log_errors"].items())
                                  or "none"),
             "statuses: " + ", ".join(f"{k} {v}" for k, v in result["statuses"].items() if not k.endswith(" OK")),
             "checks:"]
    for check, c in result["checks"].items():
        lines.append(f"  {check:<20} {'ok' if c['ok'] else str(c['violations']) + ' violation(s)'}")
        shown = [v for v in violations if v.check == check][:SHOWN]
        for v in shown:
            who = ", ".join(v.requests[:3]) + (" ..." if len(v.requests) > 3 else "")
            rid = v.evidence.get("request_id", "")
            head = f"{who}{' (' + rid + ')' if rid else ''}: " if who or rid else ""
            lines.append(f"      {head}{v.message}"[:400])
        if c["violations"] > len(shown):
            lines.append(f"      ... and {c['violations'] - len(shown)} more (see chaos.json)")
    lines.append(f"result: {result['out']}/chaos.json; logs: {result['out']}/logs")
    return "\n".join(lines)


def _in_flight(struck: list[dict]) -> str:
    if not struck:
        return "-"
    n = sorted(s["in_flight"] for s in struck)
    return f"min {n[0]}, median {n[len(n) // 2]}"


def _pairs(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items())
