"""The Operator API and its CLI through a real cluster: every RPC, its auth and error paths, and
that its controls take effect (deadlines end queued and decoding requests, drains and pauses
steer the dispatcher). Tests that pause or drain undo it in a `finally`."""

import json
import os
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdq.client import OperatorClient
from pdq.ops.child import spawn, stop
from pdq.ops.redis_server import free_port
from pdq.v1 import operator_pb2 as op_pb
from pdq.v1 import operator_pb2_grpc as op_grpc
from tests.e2e.conftest import KEYS

ROOT = Path(__file__).resolve().parents[2]
PDQ = str(ROOT / ".venv" / "bin" / "pdq")
TERMINAL = {"COMPLETED", "CANCELLED", "TIMED_OUT", "FAILED", "REJECTED"}

EMPTY_CALLS = {  # every RPC with a request that passes validation, where one is needed
    "CancelRequest": op_pb.OperatorCancelRequest(request_id="x"), "CancelTenant": op_pb.CancelTenantRequest(tenant="x"),
    "SetDeadline": op_pb.SetDeadlineRequest(request_id="x", timeout_ms=1),
    "GetRequest": op_pb.GetRequestRequest(request_id="x"), "ListRequests": op_pb.ListRequestsRequest(),
    "ListWorkers": op_pb.ListWorkersRequest(), "DrainWorker": op_pb.DrainWorkerRequest(worker_id="x"),
    "UndrainWorker": op_pb.DrainWorkerRequest(worker_id="x"), "PauseQueue": op_pb.PauseQueueRequest(tier="batch"),
    "ResumeQueue": op_pb.PauseQueueRequest(tier="batch"), "SetTenantPolicy": op_pb.TenantPolicy(tenant="x"),
    "ListTenants": op_pb.ListTenantsRequest(), "GetStats": op_pb.GetStatsRequest(),
}


@pytest.fixture
def op(cluster):
    with OperatorClient(cluster.target, api_key=KEYS["ops"]) as c:
        yield c


def wait_for(condition, timeout_s: float = 60.0, what: str = "condition"):
    """Polls a real condition until it holds (returns its value) or the time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def state_of(op, rid: str) -> str:
    return op.get_request(rid).state


def wait_state(op, rid: str, states, timeout_s: float = 60.0) -> op_pb.RequestInfo:
    states = {states} if isinstance(states, str) else set(states)
    return wait_for(lambda: (lambda i: i if i.state in states else None)(op.get_request(rid)), timeout_s,
                    f"{rid} to reach {states}")


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


@contextmanager
def paused(op, tier: str = "", tenant: str = ""):
    op.pause(tier, tenant)
    try:
        yield
    finally:
        op.pause(tier, tenant, resume=True)


def decode_workers(op) -> list[op_pb.WorkerInfo]:
    return [w for w in op.list_workers() if w.role == "decode"]


def kv_idle(op) -> bool:
    return all(w.reserved == 0 and w.running == 0 and w.kv_free_tokens == w.kv_total_tokens for w in decode_workers(op))


# -- auth ------------------------------------------------------------------------------------


def test_every_rpc_needs_an_admin_key(cluster):
    with grpc.insecure_channel(cluster.target) as channel:
        stub = op_grpc.OperatorStub(channel)
        for method, message in EMPTY_CALLS.items():
            call = getattr(stub, method)
            assert code_of(lambda: call(message, timeout=10)).code() == grpc.StatusCode.UNAUTHENTICATED, method
            bad = [("authorization", "Bearer not-a-key-at-all")]
            assert code_of(lambda: call(message, metadata=bad, timeout=10)).code() == grpc.StatusCode.UNAUTHENTICATED
            client = [("authorization", f"Bearer {KEYS['acme']}")]
            err = code_of(lambda: call(message, metadata=client, timeout=10))
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED, method
            assert "admin" in err.details()


# -- requests --------------------------------------------------------------------------------


def test_get_list_and_cancel_any_tenants_request(op, client):
    with paused(op, tenant="acme"):
        rid = client.submit("hello", max_tokens=4)
        info = op.get_request(rid)
        assert (info.request_id, info.tenant, info.tier, info.state) == (rid, "acme", "interactive", "QUEUED")
        assert info.prompt_tokens > 0 and info.max_tokens == 4 and info.created_ms > 0 and info.finished_ms == 0
        listed = op.list_requests(tenant="acme", state="QUEUED")
        assert rid in [r.request_id for r in listed.requests]
        assert op.cancel(rid) == "CANCELLED"
        assert op.cancel(rid) == "CANCELLED"  # idempotent
    info = op.get_request(rid)
    assert (info.state, info.finish_reason) == ("CANCELLED", "cancelled") and "operator" in info.error
    assert client.get_result(rid).state == "CANCELLED"  # the tenant sees it too
    for call in (lambda: op.get_request("no-such-request"), lambda: op.cancel("no-such-request"),
                 lambda: op.set_deadline("no-such-request", 100)):
        assert code_of(call).code() == grpc.StatusCode.NOT_FOUND
    err = code_of(lambda: op.get_request("bad id!"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("request_id")


def test_cancel_tenant_cancels_every_live_request_of_that_tenant_only(op, client, other_tenant):
    with paused(op, tenant="globex"), paused(op, tenant="acme"):
        theirs = [other_tenant.submit("x", max_tokens=2) for _ in range(3)]
        mine = client.submit("y", max_tokens=2)
        assert op.cancel_tenant("globex") == 3
        assert op.cancel_tenant("globex") == 0
        assert {state_of(op, r) for r in theirs} == {"CANCELLED"}
        assert state_of(op, mine) == "QUEUED"
        op.cancel(mine)
    err = code_of(lambda: op.cancel_tenant(""))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("tenant")


def test_list_requests_pages_newest_first_with_filters(op, client):
    with paused(op, tenant="acme"):
        ids = [client.submit(f"page {i}", max_tokens=2) for i in range(5)]
        batch = client.submit("batch tier", max_tokens=2, tier="batch")
        try:
            pages, token = [], ""
            while True:
                page = op.list_requests(tenant="acme", state="QUEUED", tier="interactive", page_size=2,
                                        page_token=token)
                pages.append([r.request_id for r in page.requests])
                token = page.next_page_token
                if not token:
                    break
            assert pages == [ids[::-1][:2], ids[::-1][2:4], ids[::-1][4:]]
            assert [r.request_id for r in op.list_requests(tier="batch", state="QUEUED").requests] == [batch]
            newest = op.list_requests(page_size=1)
            assert [r.request_id for r in newest.requests] == [batch] and newest.next_page_token
            assert [r.request_id for r in op.iter_requests(limit=3, tenant="acme")] == [batch, ids[4], ids[3]]
        finally:
            op.cancel_tenant("acme")
    for kw, field in ((dict(page_size=1001), "page_size"), (dict(state="SLEEPING"), "state"),
                      (dict(tier="gold"), "tier"), (dict(page_token="garbage"), "page_token")):
        err = code_of(lambda: op.list_requests(**kw))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(field), kw


# -- deadlines -------------------------------------------------------------------------------


def test_set_deadline_times_out_a_queued_request(op, client):
    with paused(op, tenant="acme"):
        rid = client.submit("wait for me", max_tokens=4)
        info = op.set_deadline(rid, 150)
        assert info.state == "QUEUED" and info.deadline_ms > info.created_ms
        ended = wait_state(op, rid, TERMINAL, timeout_s=20)
    assert (ended.state, ended.finish_reason) == ("TIMED_OUT", "timeout")
    assert ended.dispatched_ms == 0  # it never left the queue
    err = code_of(lambda: op.set_deadline(rid, 10_000))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    err = code_of(lambda: op.set_deadline(rid, 0))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("timeout_ms")


def decoding(op, rid: str, tokens: int = 2) -> op_pb.RequestInfo:
    return wait_for(lambda: (lambda i: i if i.state == "DECODING" and i.output_tokens >= tokens else None)(
        op.get_request(rid)), 120, f"{rid} to decode {tokens} tokens")


def test_set_deadline_stops_a_decoding_request_and_frees_its_kv(op, client):
    rid = client.submit("a long one", max_tokens=1500, ignore_eos=True)
    try:
        decoding(op, rid)
        op.set_deadline(rid, 1)
        ended = wait_state(op, rid, TERMINAL, timeout_s=20)
        assert (ended.state, ended.finish_reason) == ("TIMED_OUT", "timeout")
        assert ended.output_tokens < 1500
        wait_for(lambda: kv_idle(op), 20, "the decode worker to free the KV slot")
        stopped = op.get_request(rid).output_tokens
        assert client.get_result(rid).state == "TIMED_OUT" and stopped == ended.output_tokens
    finally:
        op.cancel(rid)


def test_an_extended_deadline_reaches_the_decode_worker(op, client):
    rid = client.submit("a long one", max_tokens=1500, ignore_eos=True, timeout_ms=8000)
    try:
        first = decoding(op, rid)
        op.set_deadline(rid, 600_000)
        # past the first deadline the worker, told of the new one, keeps decoding
        wait_for(lambda: time.time() * 1000 > first.deadline_ms + 1500, 30, "the old deadline to pass")
        info = op.get_request(rid)
        assert info.state in ("DECODING", "COMPLETED"), (info.state, info.error)
        assert info.output_tokens > first.output_tokens
    finally:
        op.cancel(rid)
        wait_for(lambda: kv_idle(op), 20, "KV freed")


# -- queues and tenants ----------------------------------------------------------------------


def test_a_paused_tenant_stays_queued_until_resumed_while_others_run(op, client, other_tenant):
    with paused(op, tenant="acme"):
        held = client.submit("paused", max_tokens=3)
        done = other_tenant.generate("not paused", max_tokens=3)  # the dispatcher runs meanwhile
        assert done.completion_tokens == 3
        assert state_of(op, held) == "QUEUED"
        stats = op.stats()
        assert "acme" in stats.paused_tenants
        assert [(q.tenant, q.requests) for q in stats.queues if q.tenant == "acme"] == [("acme", 1)]
        resumed = op.pause(tenant="acme", resume=True)
        assert "acme" not in resumed.paused_tenants
    assert wait_state(op, held, TERMINAL).state == "COMPLETED"


def test_a_paused_tier_stays_queued_until_resumed(op, client):
    with paused(op, tier="batch"):
        held = client.submit("batch work", max_tokens=3, tier="batch")
        assert client.generate("interactive work", max_tokens=3).completion_tokens == 3
        assert state_of(op, held) == "QUEUED"
        assert "batch" in op.stats().paused_tiers
    assert wait_state(op, held, TERMINAL).state == "COMPLETED"
    for kw, field in ((dict(), "tier"), (dict(tier="gold"), "tier")):
        err = code_of(lambda: op.pause(**kw))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(field)


def test_stats_count_queued_work_running_requests_and_kv(op, client):
    with paused(op, tenant="acme"):
        rids = [client.submit([5, 6, 7], max_tokens=5) for _ in range(2)]
        stats = op.stats()
        op.cancel_tenant("acme")
    assert [(q.tier, q.requests, q.tokens) for q in stats.queues if q.tenant == "acme"] == [("interactive", 2, 16)]
    decode = decode_workers(op)
    assert stats.kv_slots_total == sum(w.capacity for w in decode) > 0
    assert 0 <= stats.kv_slots_used <= stats.kv_slots_total
    assert {state_of(op, r) for r in rids} == {"CANCELLED"}
    long = client.submit("run", max_tokens=1500, ignore_eos=True)
    try:
        decoding(op, long)
        # the seat counts come from the workers' heartbeats, which may lag the request's state by one
        busy = wait_for(lambda: (lambda s: s if s.kv_slots_used >= 1 else None)(op.stats()), 20, "the seat in stats")
        assert busy.running >= 1
    finally:
        op.cancel(long)
    wait_for(lambda: op.stats().kv_slots_used == 0 and op.stats().running == 0, 20, "idle stats")


def test_tenant_policies_are_set_listed_and_enforced(op, other_tenant):
    before = {t.tenant: t for t in op.list_tenants()}
    assert before["globex"].weight == 2.0  # from the key file
    try:
        got = op.set_tenant_policy("globex", weight=2.0, tier="interactive", max_queued=1)
        assert (got.tenant, got.weight, got.tier, got.max_queued, got.max_queued_tokens) == (
            "globex", 2.0, "interactive", 1, 0)
        assert {t.tenant: t.max_queued for t in op.list_tenants()}["globex"] == 1
        with paused(op, tenant="globex"):
            first = other_tenant.submit("one", max_tokens=2)
            err = code_of(lambda: other_tenant.submit("two", max_tokens=2))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "TENANT_QUEUE_FULL" in err.details()
            op.cancel(first)
        cleared = op.set_tenant_policy("initech", weight=3.0)
        assert cleared.weight == 3.0 and "initech" in [t.tenant for t in op.list_tenants()]
        assert op.set_tenant_policy("initech").weight == 0.0  # all defaults: no policy left
        assert "initech" not in [t.tenant for t in op.list_tenants()]
    finally:
        b = before["globex"]
        op.set_tenant_policy("globex", b.weight, b.tier, b.max_queued, b.max_queued_tokens)
    for kw, field in ((dict(weight=-1.0), "weight"), (dict(weight=float("nan")), "weight"), (dict(tier="gold"), "tier")):
        err = code_of(lambda: op.set_tenant_policy("globex", **kw))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(field), kw
    err = code_of(lambda: op.set_tenant_policy("has space"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("tenant")


# -- workers ---------------------------------------------------------------------------------


@contextmanager
def extra_decode_worker(cluster, worker_id: str):
    """A second decode worker process on the session cluster's Redis, SERVING when entered."""
    from pdq.model.loader import resolve_model

    port = free_port("127.0.0.1")
    env = dict(os.environ, PDQ_REDIS_URL=cluster.redis_url, PDQ_MODEL=str(resolve_model("builtin")))
    proc = spawn([sys.executable, "-m", "decode_worker", "--host", "127.0.0.1", "--port", str(port),
                             "--worker-id", worker_id, "--metrics-port", "-1"], env=env)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def serving():
                assert proc.poll() is None, f"extra decode worker exited with {proc.returncode}"
                try:
                    return stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING
                except grpc.RpcError:
                    return False
            wait_for(serving, 300, "the extra decode worker")
        yield f"127.0.0.1:{port}"
    finally:
        stop(proc, 30)


def test_a_drained_worker_finishes_its_work_and_gets_no_new_work(op, client, cluster):
    extra_id = f"decode-extra-{uuid.uuid4().hex[:6]}"
    with extra_decode_worker(cluster, extra_id) as extra_address:
        wait_for(lambda: extra_id in [w.worker_id for w in decode_workers(op)], 30, "the extra worker to register")
        workers = {w.worker_id: w for w in decode_workers(op)}
        session_id = next(w for w in workers if w != extra_id)
        addresses = {extra_id: extra_address, session_id: workers[session_id].address}
        try:
            for drained, open_ in ((session_id, extra_id), (extra_id, session_id)):
                info = op.drain(drained)
                assert info.worker_id == drained and info.draining
                # its own heartbeats (at least one per second) do not undo the drain
                beat = info.heartbeat_ms
                wait_for(lambda: next(w for w in decode_workers(op) if w.worker_id == drained).heartbeat_ms > beat,
                         10, "a heartbeat of the drained worker")
                assert next(w for w in decode_workers(op) if w.worker_id == drained).draining
                rids = [client.submit(f"to {open_} {i}", max_tokens=2) for i in range(4)]
                ended = [wait_state(op, r, TERMINAL) for r in rids]
                assert {(e.state, e.decode_worker) for e in ended} == {("COMPLETED", addresses[open_])}
                undrained = op.drain(drained, undo=True)
                assert not undrained.draining
            # a worker drained while it decodes finishes that request
            long = client.submit("long", max_tokens=40, ignore_eos=True)
            running = decoding(op, long, 1)
            holder = next(w for w, a in addresses.items() if a == running.decode_worker)
            op.drain(holder)
            done = wait_state(op, long, TERMINAL, timeout_s=120)
            assert (done.state, done.output_tokens, done.decode_worker) == ("COMPLETED", 40, running.decode_worker)
        finally:
            for wid in addresses:
                op.drain(wid, undo=True)
    err = code_of(lambda: op.drain("no-such-worker"))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: op.drain("")).code() == grpc.StatusCode.INVALID_ARGUMENT


def test_list_workers_shows_every_live_worker(op, cluster):
    workers = op.list_workers()
    roles = sorted(w.role for w in workers if not w.draining)
    assert roles.count("prefill") >= 1 and roles.count("decode") >= 1
    for w in workers:
        if w.draining:  # e.g. a worker that left and is not reaped yet
            continue
        assert w.address and w.heartbeat_ms > time.time() * 1000 - 15_000
        assert 0 < w.kv_free_tokens <= w.kv_total_tokens and w.kv_block_size == 16
        assert w.role == "prefill" or w.capacity > 0  # decode seats


# -- CLI -------------------------------------------------------------------------------------


def pdq(cluster, *args: str, key: str = KEYS["ops"]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PDQ_API_KEY=key, PDQ_TARGET=cluster.target)
    return subprocess.run([PDQ, *args], env=env, capture_output=True, text=True, timeout=60)


def test_cli_operator_commands(op, client, cluster):
    with paused(op, tenant="acme"):
        rid = client.submit("cli", max_tokens=2)
        out = pdq(cluster, "requests", "--tenant", "acme", "--state", "queued")
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines()[0].split()[:4] == ["ID", "TENANT", "TIER", "STATE"]
        row = next(line.split() for line in out.stdout.splitlines() if line.startswith(rid))
        assert row[1:4] == ["acme", "interactive", "QUEUED"]
        listed = json.loads(pdq(cluster, "requests", "--json", "--limit", "1").stdout)
        assert [r["request_id"] for r in listed] == [rid]
        shown = pdq(cluster, "request", rid)
        assert "state:" in shown.stdout and "QUEUED" in shown.stdout
        table = pdq(cluster, "stats").stdout
        assert "paused tenants: acme" in table and ["interactive", "acme", "1"] in [l.split()[:3] for l in table.splitlines()]
        stats = json.loads(pdq(cluster, "stats", "--json").stdout)
        assert "acme" in stats["paused_tenants"]
        moved = pdq(cluster, "deadline", rid, "600000")
        assert moved.returncode == 0 and "QUEUED" in moved.stdout
        cancelled = pdq(cluster, "cancel", rid)
        assert cancelled.returncode == 0 and cancelled.stdout.strip() == f"{rid} CANCELLED"
        assert json.loads(pdq(cluster, "cancel", "--tenant", "acme", "--json").stdout)["cancelled"] == 0
    out = pdq(cluster, "pause", "--tier", "batch")
    try:
        assert out.returncode == 0 and "paused tiers: batch" in out.stdout
    finally:
        out = pdq(cluster, "resume", "--tier", "batch")
    assert out.returncode == 0 and "paused tiers: -" in out.stdout
    workers = json.loads(pdq(cluster, "workers", "--json").stdout)
    decode = next(w for w in workers if w["role"] == "decode" and not w["draining"])
    assert "DRAINING" in pdq(cluster, "workers").stdout
    try:
        drained = pdq(cluster, "drain", decode["worker_id"])
        assert drained.returncode == 0 and f"{decode['worker_id']}" in drained.stdout and " yes " in drained.stdout
    finally:
        undrained = pdq(cluster, "undrain", decode["worker_id"])
    assert undrained.returncode == 0 and " no " in undrained.stdout
    tenants = pdq(cluster, "tenants")
    assert tenants.returncode == 0 and "globex" in tenants.stdout
    set_ = pdq(cluster, "tenants", "set", "initech", "--weight", "2.5", "--json")
    assert json.loads(set_.stdout)[0]["weight"] == 2.5, set_.stderr
    assert pdq(cluster, "tenants", "set", "initech").returncode == 0  # back to defaults
    denied = pdq(cluster, "workers", key=KEYS["acme"])
    assert denied.returncode == 1 and "PERMISSION_DENIED" in denied.stderr
    missing = pdq(cluster, "request", "no-such-request")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr


def test_get_result_waits_longer_than_the_redis_socket_timeout(op, client):
    """A long-poll longer than the Redis client's socket timeout (5 s) returns the state, not
    an error: the gateway's wait is made of short blocking reads."""
    with paused(op, tenant="acme"):
        rid = client.submit("hello", max_tokens=2)
        started = time.monotonic()
        got = client.get_result(rid, wait_ms=6_500)
        assert (got.state, got.done) == ("QUEUED", False)
        assert time.monotonic() - started >= 6.4  # it did wait the whole time
    assert client.get_result(rid, wait_ms=60_000).done
