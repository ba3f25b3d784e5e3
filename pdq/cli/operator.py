"""The operator commands of `pdq` (Operator API, admin key): requests, request, cancel, deadline,
workers, drain, undrain, pause, resume, tenants, stats.

They print plain tables (or JSON with --json) on stdout. The key is --api-key, else
$PDQ_API_KEY, else the admin dev key of a local `pdq up` on --target.
"""

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

DEFAULT_TARGET = "127.0.0.1:50051"


def table(rows: list[list[str]], header: list[str]) -> str:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header] + rows]
    return "\n".join(lines)


def _span(s: float) -> str:
    return f"{s:.1f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.0f}h"


def left(ms: int) -> str:
    """Unix ms to come -> "25.0s left"."""
    return f"{_span(max(0.0, ms / 1000 - time.time()))} left"


def ago(ms: int) -> str:
    """Unix ms -> "3.2s ago", or "in 3.2s" for a time to come ("-" when unset)."""
    if not ms:
        return "-"
    s = time.time() - ms / 1000
    return f"{_span(s)} ago" if s >= 0 else f"in {_span(-s)}"


def as_dict(message) -> dict:
    """A message as JSON-ready data, 64-bit integers as numbers (not strings)."""
    out = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for f in message.DESCRIPTOR.fields:
        value = getattr(message, f.name)
        if f.message_type is not None:
            out[f.name] = as_dict(value) if isinstance(value, Message) else [as_dict(v) for v in value]
        elif f.type in (f.TYPE_INT64, f.TYPE_UINT64):
            out[f.name] = value
    return out


def _print_requests(infos: list, args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps([as_dict(r) for r in infos]))
        return
    rows = [[r.request_id, r.tenant, r.tier, r.state, str(r.prompt_tokens), f"{r.output_tokens}/{r.max_tokens}",
             ago(r.created_ms), r.decode_worker or r.prefill_worker or "-"] for r in infos]
    print(table(rows, ["ID", "TENANT", "TIER", "STATE", "PROMPT", "OUT/MAX", "CREATED", "WORKER"]))


def _requests(op, args):
    infos = list(op.iter_requests(limit=args.limit, tenant=args.tenant, state=args.state.upper(), tier=args.tier))
    _print_requests(infos, args)


def _request(op, args):
    info = op.get_request(args.request_id)
    if args.json:
        print(json.dumps(as_dict(info)))
        return
    for key, value in as_dict(info).items():
        if key.endswith("_ms") and key != "deadline_ms" and value not in (0, "0"):
            value = f"{value} ({ago(int(value))})"
        print(f"{key + ':':16} {value}")


def _cancel(op, args):
    if bool(args.request_id) == bool(args.tenant):
        raise SystemExit("pdq cancel: give a request id or --tenant (one of them)")
    if args.tenant:
        n = op.cancel_tenant(args.tenant)
        print(json.dumps({"tenant": args.tenant, "cancelled": n}) if args.json
              else f"cancelled {n} request(s) of tenant {args.tenant}")
    else:
        state = op.cancel(args.request_id)
        print(json.dumps({"request_id": args.request_id, "state": state}) if args.json else f"{args.request_id} {state}")


def _deadline(op, args):
    info = op.set_deadline(args.request_id, args.ms)
    print(json.dumps(as_dict(info)) if args.json else f"{info.request_id} {info.state}, deadline in {args.ms} ms")


def _print_workers(workers: list, args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps([as_dict(w) for w in workers]))
        return
    rows = [[w.worker_id, w.role, w.address, str(w.running), f"{w.free_slots}/{w.capacity}",
             f"{w.kv_free_tokens}/{w.kv_total_tokens} ({w.kv_block_size})",
             "yes" if w.draining else "no", left(w.quarantined_until_ms) if w.quarantined_until_ms else "no",
             ago(w.heartbeat_ms)] for w in workers]
    print(table(rows, ["ID", "ROLE", "ADDRESS", "RUNNING", "FREE/CAP", "KV FREE/TOTAL (BLOCK)", "DRAINING",
                       "QUARANTINED", "HEARTBEAT"]))
    for w in workers:
        if w.quarantined_until_ms:
            print(f"{w.worker_id}: quarantined ({left(w.quarantined_until_ms)}): {w.quarantine_reason}")


def _workers(op, args):
    _print_workers(op.list_workers(), args)


def _drain(undo: bool) -> Callable:
    def run(op, args):
        _print_workers([op.drain(args.worker_id, undo=undo or args.undo)], args)
    return run


def _pause(resume: bool) -> Callable:
    def run(op, args):
        if not args.tier and not args.tenant:
            raise SystemExit(f"pdq {'resume' if resume else 'pause'}: give --tier and/or --tenant")
        got = op.pause(args.tier, args.tenant, resume=resume)
        print(json.dumps(as_dict(got)) if args.json else
              f"paused tiers: {', '.join(got.paused_tiers) or '-'}; paused tenants: {', '.join(got.paused_tenants) or '-'}")
    return run


def _print_tenants(policies: list, args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps([as_dict(p) for p in policies]))
        return
    rows = [[p.tenant, f"{p.weight:g}" if p.weight else "default", p.tier or "default",
             str(p.max_queued or "default"), str(p.max_queued_tokens or "default")] for p in policies]
    print(table(rows, ["TENANT", "WEIGHT", "TIER", "MAX_QUEUED", "MAX_QUEUED_TOKENS"]))


def _tenants(op, args):
    if getattr(args, "tenants_command", None) == "set":
        _print_tenants([op.set_tenant_policy(args.name, args.weight, args.tier, args.max_queued,
                                             args.max_queued_tokens)], args)
    else:
        _print_tenants(op.list_tenants(), args)


def _stats(op, args):
    s = op.stats()
    if args.json:
        print(json.dumps(as_dict(s)))
        return
    print(f"running: {s.running}   decode seats: {s.kv_slots_used}/{s.kv_slots_total} used   "
          f"KV: {s.kv_tokens_used}/{s.kv_tokens_total} tokens used")
    print(f"paused tiers: {', '.join(s.paused_tiers) or '-'}   paused tenants: {', '.join(s.paused_tenants) or '-'}")
    rows = [[q.tier, q.tenant, str(q.requests), str(q.tokens)] for q in s.queues]
    print(table(rows, ["TIER", "TENANT", "QUEUED", "TOKENS"]) if rows else "queue: empty")


def _runner(name: str, fn: Callable) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from pdq.client import OperatorClient

        with OperatorClient(args.target, api_key=args.api_key, tls_ca=args.tls_ca) as op:
            try:
                fn(op, args)
            except grpc.RpcError as exc:
                print(f"pdq {name}: {exc.code().name}: {exc.details()}", file=sys.stderr)
                return 1
        return 0
    return run


def _common(p: argparse.ArgumentParser, nested: bool = False) -> None:
    """The connection and output flags (nested: on a sub-command, leaving the parent's values)."""
    def default(value):
        return argparse.SUPPRESS if nested else value
    p.add_argument("--target", default=default(os.environ.get("PDQ_TARGET", DEFAULT_TARGET)), help="gateway host:port")
    p.add_argument("--api-key", default=default(None),
                   help="admin API key (default: $PDQ_API_KEY, else the admin dev key of a local `pdq up`)")
    p.add_argument("--tls-ca", default=default(None), help="CA certificate (PEM) of a TLS gateway (default: $PDQ_TLS_CA)")
    p.add_argument("--json", action="store_true", default=default(False), help="print JSON instead of a table")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Registers the operator commands on the `pdq` command's subparsers."""
    def command(name: str, fn: Callable, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help + " (Operator API: needs an admin key)")
        _common(p)
        p.set_defaults(func=_runner(name, fn))
        return p

    p = command("requests", _requests, "list requests, newest first")
    p.add_argument("--tenant", default="", help="only this tenant's")
    p.add_argument("--state", default="", help="only in this state (QUEUED, DECODING, COMPLETED, CANCELLED, ...)")
    p.add_argument("--tier", default="", help="only this tier")
    p.add_argument("--limit", type=int, default=20, help="at most this many (default 20; 0 = all)")
    command("request", _request, "show one request: state, timings, workers, tokens").add_argument("request_id")
    p = command("cancel", _cancel, "cancel a request (any tenant's) or every live request of a tenant")
    p.add_argument("request_id", nargs="?", default="")
    p.add_argument("--tenant", default="", help="cancel every live request of this tenant")
    p = command("deadline", _deadline, "move a queued or running request's deadline to MS milliseconds from now")
    p.add_argument("request_id")
    p.add_argument("ms", type=int)
    command("workers", _workers, "list the live workers")
    p = command("drain", _drain(False), "drain a worker: no new work, it finishes what it runs")
    p.add_argument("worker_id")
    p.add_argument("--undo", action="store_true", help="end the drain (same as `pdq undrain`)")
    p = command("undrain", _drain(True), "end a worker's drain")
    p.add_argument("worker_id")
    p.set_defaults(undo=True)
    for name, resume in (("pause", False), ("resume", True)):
        p = command(name, _pause(resume), f"{name} dispatching a tier's or a tenant's queued requests")
        p.add_argument("--tier", default="")
        p.add_argument("--tenant", default="")
    p = command("tenants", _tenants, "list tenant policies, or `tenants set NAME ...` one")
    tsub = p.add_subparsers(dest="tenants_command")
    s = tsub.add_parser("set", help="set a tenant's whole policy (unset fields: the scheduler's default)")
    s.add_argument("name")
    _common(s, nested=True)
    s.add_argument("--weight", type=float, default=0.0, help="fair-share weight (> 0)")
    s.add_argument("--tier", default="", help="best tier its requests may use")
    s.add_argument("--max-queued", type=int, default=0, help="most queued requests")
    s.add_argument("--max-queued-tokens", type=int, default=0, help="most queued prompt + max_tokens tokens")
    command("stats", _stats, "queue depth per tier and tenant, running requests, KV use")
