"""The scheduler service on a real Redis and real gRPC, with fake workers: admission with retry
hints, idempotent submit, tiers, fair share, cancellation, deadlines, dead workers and leases."""

import asyncio

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from pdq.state.registry import live_workers
from pdq.state.store import TenantPolicy, now_ms
from scheduler import janitor
from pdq.v1 import internal_pb2 as pb
from tests.scheduler.fakes import wait_for
from tests.scheduler.harness import ended, harness, spec, token_indices

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture
def url(redis_server):
    return redis_server.url


# -- admission ------------------------------------------------------------------------------------

async def test_over_the_bound_the_caller_gets_resource_exhausted_with_a_retry_hint(url, prefix):
    async with harness(url, prefix, tenant_max_queued=2, retry_after_min_ms=250) as h:
        await h.submit(spec("r1"))
        await h.submit(spec("r2"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.submit(spec("r3"))
        exc = err.value
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert exc.details().startswith("TENANT_QUEUE_FULL: ") and "retry in" in exc.details()
        meta = dict(exc.trailing_metadata())
        delay = int(meta["grpc-retry-pushback-ms"])
        assert 250 <= delay <= h.config.retry_after_max_ms
        status = status_pb2.Status.FromString(meta["grpc-status-details-bin"])
        info, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
        assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert status.details[0].Unpack(info) and status.details[1].Unpack(retry)
        assert info.reason == "TENANT_QUEUE_FULL" and retry.retry_delay.ToMilliseconds() == delay
        assert await h.store.record("r3") == {}
        assert (await h.submit(spec("other", tenant="globex"))).created  # another tenant still gets in


async def test_submit_many_answers_each_item_as_a_submit_of_its_own_would_and_one_refused_refuses_no_other(
        url, prefix):
    from gateway.submits import outcome_error

    def hashed(rid: str, digest: str) -> pb.RequestSpec:
        s = spec(rid)
        s.content_hash = digest
        return s
    async with harness(url, prefix, tenant_max_queued=3, retry_after_min_ms=250) as h:
        items = [pb.SubmitRequest(spec=spec("r1")), pb.SubmitRequest(spec=spec("r1")),  # the same id twice
                 pb.SubmitRequest(spec=hashed("r2", "d1"), idempotency_key="k"),
                 pb.SubmitRequest(spec=hashed("r3", "d2"), idempotency_key="k"),  # the key reused, other content
                 pb.SubmitRequest(spec=spec("r4", tier="vip")),  # no such tier
                 pb.SubmitRequest(spec=spec("r5", tenant="")),  # no tenant
                 pb.SubmitRequest(spec=spec("r6")),
                 pb.SubmitRequest(spec=spec("r7")),  # the tenant's fourth: over its bound of 3
                 pb.SubmitRequest(spec=spec("g1", tenant="globex"))]
        got = (await h.stub.SubmitMany(pb.SubmitManyRequest(items=items), timeout=5)).items
        assert [o.code for o in got] == [0, 0, 0, grpc.StatusCode.ALREADY_EXISTS.value[0],
                                        grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                        grpc.StatusCode.INVALID_ARGUMENT.value[0], 0,
                                        grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], 0]
        assert [(o.response.request_id, o.response.created) for o in got if o.code == 0] == [
            ("r1", True), ("r1", False), ("r2", True), ("r6", True), ("g1", True)]
        assert got[4].message.startswith("tier:") and "request_id, tenant" in got[5].message
        full = outcome_error(got[7])
        assert full.details().startswith("TENANT_QUEUE_FULL: ") and "retry in" in full.details()
        meta = dict(full.trailing_metadata())
        assert int(meta["grpc-retry-pushback-ms"]) >= 250
        assert status_pb2.Status.FromString(meta["grpc-status-details-bin"]).code == full.code().value[0]
        with pytest.raises(grpc.aio.AioRpcError) as alone:  # the same submit alone: the same answer
            await h.submit(spec("r7"))
        assert (alone.value.code(), alone.value.details().split(";")[0]) == (full.code(), full.details().split(";")[0])
        conflict = outcome_error(got[3])
        assert conflict.code() == grpc.StatusCode.ALREADY_EXISTS and "'k' was already used" in conflict.details()
        assert [await h.state(r) for r in ("r1", "r2", "r3", "r4", "r6", "r7", "g1")] == [
            "QUEUED", "QUEUED", "", "", "QUEUED", "", "QUEUED"]


async def test_concurrent_submits_through_the_gateways_client_go_in_fewer_calls_each_answered(url, prefix):
    from gateway.schedulers import Schedulers

    async with harness(url, prefix) as h:
        client = Schedulers([f"127.0.0.1:{h.server.port}"])
        try:
            got = await asyncio.gather(*(client.Submit(pb.SubmitRequest(spec=spec(f"c{i}", tier="vip" if i == 7 else "")),
                                                       timeout=5) for i in range(40)), return_exceptions=True)
        finally:
            await client.close()
        refused = got.pop(7)
        assert isinstance(refused, grpc.aio.AioRpcError) and refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [g.request_id for g in got] == [f"c{i}" for i in range(40) if i != 7] and all(g.created for g in got)
        assert client.submits.calls < 40  # those at hand went together
        assert {await h.state(f"c{i}") for i in range(40) if i != 7} == {"QUEUED"}


async def test_a_tenant_policy_in_redis_overrides_the_default_bounds_and_tier(url, prefix):
    async with harness(url, prefix) as h:
        await h.store.set_tenant_policy("acme", TenantPolicy(max_queued=1, tier="batch"))
        await h.submit(spec("r1", tier="interactive"))
        assert (await h.store.record("r1"))["tier"] == "batch"  # capped at its tier
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.submit(spec("r2"))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_an_unknown_tier_is_an_invalid_argument(url, prefix):
    async with harness(url, prefix) as h:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.submit(spec("r1", tier="vip"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("tier:")


async def test_a_request_no_decode_workers_kv_pool_can_ever_hold_is_an_invalid_argument_with_the_numbers(
        url, prefix):
    async with harness(url, prefix, workers={"decode": 2, "kv_tokens": 1000}) as h:
        async def pools_registered():
            live = await live_workers(h.store, ("decode",), 5.0)
            return len([w for w in live["decode"] if w.kv_total_tokens == 1000]) == 2

        await wait_for(pools_registered)  # the fake workers' first heartbeats are in the registry
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.submit(spec("too-big", prompt=600, max_tokens=500))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "600-token prompt plus max_tokens 500 needs 1100 KV positions" in err.value.details()
        assert "holds 1000" in err.value.details()
        assert await h.state("too-big") == ""  # nothing was queued
        await h.submit(spec("fits", prompt=600, max_tokens=400))  # exactly the largest pool: it runs
        assert await ended(h, ["fits"]) == ["COMPLETED"]
    async with harness(url, prefix + "x") as h:  # no decode worker known yet: nothing to judge by, it waits
        assert (await h.submit(spec("big-early", prompt=600, max_tokens=500))).created


async def test_a_retried_submit_with_the_same_key_gives_one_request(url, prefix):
    async with harness(url, prefix, workers={}) as h:
        first = await h.submit(spec("a"), key="client-key-1")
        again = await h.submit(spec("b"), key="client-key-1")
        assert first.created and not again.created and again.request_id == "a"
        await ended(h, ["a"])
        assert await h.store.record("b") == {}
        assert await token_indices(h, "a") == [0, 1, 2, 3]


async def test_a_reused_request_id_with_other_content_is_already_exists_naming_it(url, prefix):
    async with harness(url, prefix) as h:
        first = spec("a")
        first.content_hash, first.client_request_id = "digest-1", "my-id"
        assert (await h.submit(first, key="my-id")).created
        retry = spec("b")  # the gateway gives every call its own internal id
        retry.content_hash, retry.client_request_id = "digest-1", "my-id"
        again = await h.submit(retry, key="my-id")
        assert (again.created, again.request_id) == (False, "a")  # a true retry: the first request
        other = spec("c", prompt=9)
        other.content_hash, other.client_request_id = "digest-2", "my-id"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.submit(other, key="my-id")
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "'my-id'" in err.value.details() and "different request" in err.value.details()
        assert "new request_id" in err.value.details()
        assert await h.store.record("c") == {}
        assert (await h.store.record("a"))["client_request_id"] == "my-id"


# -- dispatch order ---------------------------------------------------------------------------------

async def test_every_request_is_served_once_by_the_fake_workers(url, prefix):
    async with harness(url, prefix, workers=dict(decode=2, slots=3)) as h:
        rids = [f"r{k}" for k in range(20)]
        for rid in rids:
            await h.submit(spec(rid, max_tokens=6))
        await ended(h, rids)
        for rid in rids:
            assert await token_indices(h, rid) == list(range(6))
        assert (await h.store.load()).get("n", 0) == 0


async def test_prompts_go_only_to_decode_workers_of_their_prefill_workers_dtype(url, prefix, caplog):
    """A KV hand-off in another dtype is refused, so a bfloat16 prefill worker's prompts go to the
    bfloat16 decode worker alone; and a prefill worker no decode worker matches gets no work, with
    a warning that names it."""
    async with harness(url, prefix, workers=dict(decode=2, slots=4, kv_dtypes=("float32", "bfloat16"),
                                                 prefill_kv_dtype="bfloat16")) as h:
        rids = [f"r{k}" for k in range(8)]
        for rid in rids:
            await h.submit(spec(rid, max_tokens=3))
        await ended(h, rids)
        f32, bf16 = h.workers.decoders.values()
        assert f32.kv_dtype == "float32" and bf16.kv_dtype == "bfloat16"
        assert f32.reserve_calls == [] and bf16.reserve_calls  # never even asked for a slot
        for rid in rids:
            assert await token_indices(h, rid) == [0, 1, 2]
            assert (await h.store.record(rid))["decode_worker"] == bf16.address
    async with harness(url, prefix + "b", workers=dict(decode=1, kv_dtypes=("float32",),
                                                       prefill_kv_dtype="bfloat16")) as h:
        with caplog.at_level("WARNING", logger="pdq.scheduler"):
            await h.submit(spec("x", max_tokens=2))

            async def warned() -> bool:
                return "get no work: no decode worker runs their dtype" in caplog.text

            await wait_for(warned)
        assert "prefill-0 (bfloat16)" in caplog.text and "float32" in caplog.text
        assert h.workers.prefillers[0].batches == []  # nothing sent to be refused
        assert (await h.store.record("x"))["state"] == "QUEUED"  # it waits for a worker that can take it


async def test_a_dispatch_round_reserves_its_slots_all_at_once(url, prefix):
    """One call to a decode worker per round (ReserveMany), not one per request: a request
    submitted while a round places others waits for one reply, not for a reply per request."""
    async with harness(url, prefix, max_batch_size=6) as h:
        rids = [f"r{k}" for k in range(6)]
        for rid in rids:
            await h.submit(spec(rid, max_tokens=3))
        workers = await h.start_workers(slots=8, reserve_s=0.05)
        await ended(h, rids)
        decode = next(iter(workers.decoders.values()))
        assert decode.reserve_calls == [6]  # the whole round's reservations in one call
        assert (await h.store.load()).get("n", 0) == 0


async def test_a_freed_decode_slot_takes_the_next_queued_request_without_waiting_for_a_poll(url, prefix):
    """With requests queued, a worker's heartbeat wakes the dispatcher (its poll is a minute
    here): the queue drains through one slot. (With the queue empty, heartbeats do not wake it.)"""
    async with harness(url, prefix, workers=dict(slots=1), dispatch_interval_ms=60_000) as h:
        rids = [f"r{k}" for k in range(3)]
        for rid in rids:
            await h.submit(spec(rid, max_tokens=3))
        await ended(h, rids)
        assert (await h.store.load()).get("n", 0) == 0


async def test_a_request_a_worker_requeues_is_dispatched_again_without_waiting_for_a_poll(url, prefix):
    """A requeue by someone else than the scheduler (a decode worker that lost a sequence) puts a
    request in a queue the dispatcher last read as empty: the queued channel wakes it (its poll
    is a minute here; heartbeats do not wake it while the queue looks empty)."""
    async with harness(url, prefix, workers=dict(slots=2, step_s=0.05), dispatch_interval_ms=60_000) as h:
        await h.submit(spec("r1", max_tokens=40))

        async def decoding() -> bool:
            return await h.state("r1") == "DECODING" and h.server.dispatcher._queue_empty

        await wait_for(decoding)
        epoch = int((await h.store.record("r1"))["epoch"])
        assert await h.store.requeue("r1", epoch, "decode worker lost it", 3) == "QUEUED"

        async def dispatched_again() -> bool:
            rec = await h.store.record("r1")
            return int(rec["epoch"]) > epoch and rec["state"] != "QUEUED"

        await wait_for(dispatched_again)
        await ended(h, ["r1"])
        assert await token_indices(h, "r1") == list(range(40))


async def test_a_resumed_queue_is_dispatched_without_waiting_for_a_poll(url, prefix):
    """Requests of a paused tenant stay queued and out of the snapshot; an operator's resume
    (which writes Redis, not the scheduler) wakes the dispatcher on the queued channel."""
    async with harness(url, prefix, workers=dict(slots=2), dispatch_interval_ms=60_000) as h:
        await h.store.pause(tenant="acme")
        await h.submit(spec("r1"))

        async def read_as_empty() -> bool:
            return h.server.dispatcher._queue_empty

        await wait_for(read_as_empty)  # the submit's poke read the queue: nothing to dispatch
        assert await h.state("r1") == "QUEUED"
        assert await h.store.pause(tenant="acme", paused=False) == 1
        await ended(h, ["r1"])


async def test_interactive_goes_before_batch(url, prefix):
    async with harness(url, prefix, max_batch_size=1) as h:
        for k in range(3):
            await h.submit(spec(f"b{k}", tier="batch"))
        for k in range(3):
            await h.submit(spec(f"i{k}", tier="interactive"))
        await h.start_workers(slots=1)
        await ended(h, [f"b{k}" for k in range(3)] + [f"i{k}" for k in range(3)])
        assert h.workers.prefillers[0].batches == [["i0"], ["i1"], ["i2"], ["b0"], ["b1"], ["b2"]]


async def test_a_batch_that_leaves_queued_requests_out_says_more_is_coming(url, prefix):
    """PrefillBatch.more_coming (an idle colocated worker waits for the rest of a burst): set on
    a batch its size cut short, not on the one that takes the last queued request."""
    async with harness(url, prefix, max_batch_size=2) as h:
        for k in range(5):
            await h.submit(spec(f"r{k}"))
        await h.start_workers(slots=8)
        await ended(h, [f"r{k}" for k in range(5)])
        prefill = h.workers.prefillers[0]
        assert prefill.batches == [["r0", "r1"], ["r2", "r3"], ["r4"]]
        assert prefill.more_coming == [True, True, False]


async def test_a_batch_that_takes_the_last_free_seats_says_nothing_more_is_coming(url, prefix):
    """With requests still queued but no decode seat left, nothing more can come until sequences
    end: a worker told otherwise would wait out its gather window idle (a saturated colocated
    worker did, ~100 ms per pair of batches)."""
    async with harness(url, prefix, max_batch_size=2) as h:
        for k in range(5):
            await h.submit(spec(f"r{k}", max_tokens=50))
        await h.start_workers(slots=2, step_s=0.01)
        await ended(h, [f"r{k}" for k in range(5)])
        prefill = h.workers.prefillers[0]
        assert prefill.batches[0] == ["r0", "r1"]
        assert prefill.more_coming[0] is False


async def test_a_flooding_tenant_gets_no_more_than_its_share(url, prefix):
    """Two equal-weight tenants, one with 10x the other's requests, both backlogged: while both
    wait, each is served half of the tokens."""
    async with harness(url, prefix, max_batch_size=2) as h:
        heavy = [f"h{k}" for k in range(100)]
        light = [f"l{k}" for k in range(10)]
        for rid in heavy:
            await h.submit(spec(rid, tenant="heavy", prompt=8, max_tokens=8))
        for rid in light:
            await h.submit(spec(rid, tenant="light", prompt=8, max_tokens=8))
        await h.start_workers(slots=2, step_s=0.001)
        await ended(h, light)
        records = {rid: await h.store.record(rid) for rid in heavy + light}
        last_light = max(int(records[r]["dispatched_ms"]) for r in light)
        served = [r for r in heavy if records[r].get("dispatched_ms") and int(records[r]["dispatched_ms"]) < last_light]
        # light's 10 requests (160 tokens) against what heavy got meanwhile: at most a batch apart
        assert 8 <= len(served) <= 12, len(served)


async def test_prefill_priority_puts_a_tenant_below_its_share_first(url, prefix):
    """Each PrefillItem says how urgent its prefill is: by tier, then below/at the tenant's fair
    share of decode slots. A tenant alone is 0; once another tenant is active, a tenant holding
    its share or more gets 1 and the other 0; the batch tier 2 or 3."""
    async with harness(url, prefix, max_batch_size=1) as h:
        heavy = [f"h{k}" for k in range(6)]
        for rid in heavy:
            await h.submit(spec(rid, tenant="heavy", prompt=8, max_tokens=150))
        await h.start_workers(slots=8, step_s=0.01)  # heavy's sequences run ~1.5 s

        async def heavy_all_dispatched() -> bool:
            return len(h.workers.prefillers[0].priorities) == len(heavy)

        await wait_for(heavy_all_dispatched)
        await h.submit(spec("l0", tenant="light", prompt=8, max_tokens=4))
        await h.submit(spec("h6", tenant="heavy", prompt=8, max_tokens=4))
        await h.submit(spec("b0", tenant="light", tier="batch", prompt=8, max_tokens=4))
        await ended(h, heavy + ["l0", "h6", "b0"])
        got = h.workers.prefillers[0].priorities
        assert [got[r] for r in heavy] == [0] * len(heavy)  # alone
        assert got["l0"] == 0  # light holds nothing: below its share
        assert got["h6"] == 1  # heavy holds 6 of 8 slots, its share is 4
        assert got["b0"] in (2, 3)


# -- cancellation and deadlines -------------------------------------------------------------------

async def test_cancel_of_a_queued_request_ends_it_at_once(url, prefix):
    async with harness(url, prefix) as h:
        await h.submit(spec("r"))
        resp = await h.stub.Cancel(pb.InternalCancelRequest(request_id="r", tenant="acme", reason="client"))
        assert resp.state == "CANCELLED" and await h.state("r") == "CANCELLED"
        assert (await h.store.load()).get("n", 0) == 0
        with pytest.raises(grpc.aio.AioRpcError) as err:  # another tenant cannot see it
            await h.stub.Cancel(pb.InternalCancelRequest(request_id="r", tenant="globex"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_cancel_of_a_decoding_request_frees_its_decode_slot(url, prefix):
    async with harness(url, prefix, workers=dict(slots=1)) as h:
        await h.submit(spec("long", max_tokens=100_000))
        await wait_for(lambda: _in_state(h, "long", "DECODING"))
        decode = next(iter(h.workers.decoders.values()))
        assert set(decode.holds) == {"long"}
        await h.stub.Cancel(pb.InternalCancelRequest(request_id="long"))
        await wait_for(lambda: _true(not decode.holds and not decode.running))
        await h.submit(spec("next"))  # the slot is free for the next request
        await ended(h, ["next"])


async def test_a_queued_request_past_its_deadline_times_out(url, prefix):
    async with harness(url, prefix) as h:
        await h.submit(spec("r", deadline_ms=now_ms() + 100))
        await ended(h, ["r"], ("TIMED_OUT",))
        rec = await h.store.record("r")
        assert rec["finish_reason"] == "timeout" and int(rec["finished_ms"]) >= int(rec["deadline_ms"])
        assert (await h.store.load()).get("n", 0) == 0


async def test_the_janitor_sleeps_until_a_deadline_and_is_woken_by_new_ones(url, prefix, monkeypatch):
    """No polling: with nothing due for a minute (reaps 15 s apart, MAX_SLEEP_S 60 s), a request
    submitted with a deadline, and one whose deadline an operator sets, still time out at once."""
    monkeypatch.setattr(janitor, "MAX_SLEEP_S", 60.0)
    async with harness(url, prefix, worker_timeout_s=60.0) as h:
        await h.submit(spec("a", deadline_ms=now_ms() + 100))  # Submit pokes it
        await ended(h, ["a"], ("TIMED_OUT",))
        await h.submit(spec("b"))  # no deadline, queued (no workers)
        assert await h.state("b") == "QUEUED"
        await h.store.set_deadline("b", now_ms() + 100)  # as the operator API does: the deadline channel
        await ended(h, ["b"], ("TIMED_OUT",))
        for rid in ("a", "b"):
            rec = await h.store.record(rid)
            assert int(rec["finished_ms"]) - int(rec["deadline_ms"]) < 10_000  # not a 60 s sleep later


async def test_a_burst_with_later_deadlines_does_not_wake_the_janitor_per_request(url, prefix, monkeypatch):
    """Deadlines later than the janitor's sleep leave it asleep (its next sweep sees them); an
    earlier one still wakes it at once."""
    monkeypatch.setattr(janitor, "MAX_SLEEP_S", 60.0)
    sweeps = 0
    sweep = janitor.Janitor.sweep

    async def counted(self):
        nonlocal sweeps
        sweeps += 1
        await sweep(self)
    monkeypatch.setattr(janitor.Janitor, "sweep", counted)
    async with harness(url, prefix, worker_timeout_s=60.0) as h:
        jan = h.server.janitor
        await wait_for(lambda: _true(jan._wake_ms is not None))  # asleep after its first sweep
        before = sweeps
        for i in range(10):
            await h.submit(spec(f"far{i}", deadline_ms=now_ms() + 3_600_000))
        assert sweeps == before and jan._wake_ms is not None
        await h.submit(spec("soon", deadline_ms=now_ms() + 100))
        await ended(h, ["soon"], ("TIMED_OUT",))
        assert sweeps > before
        assert {await h.state(f"far{i}") for i in range(10)} == {"QUEUED"}


# -- dead workers and leases ------------------------------------------------------------------------

async def test_a_dead_decode_workers_requests_finish_on_another_with_every_token_once(url, prefix):
    async with harness(url, prefix, workers=dict(decode=2, slots=2, step_s=0.01)) as h:
        rids = ["a", "b", "c"]
        for rid in rids:
            await h.submit(spec(rid, max_tokens=60))
        await wait_for(lambda: _all_in_state(h, rids, "DECODING"))
        victim = max(h.workers.decoders.values(), key=lambda d: len(d.running))
        moved = list(victim.running)
        await victim.kill()
        await ended(h, rids)
        for rid in rids:
            assert await token_indices(h, rid) == list(range(60))
        for rid in moved:
            rec = await h.store.record(rid)
            assert rec["attempts"] == "2" and rec["decode_worker"] != victim.address


async def test_a_dead_prefill_worker_costs_a_request_at_most_one_attempt(url, prefix):
    async with harness(url, prefix, worker_timeout_s=5) as h:  # reaped late: the dispatcher must notice by itself
        workers = await h.start_workers(prefill=2)
        await workers.prefillers[0].kill()
        rids = [f"r{k}" for k in range(6)]
        for rid in rids:
            await h.submit(spec(rid))
        await ended(h, rids)
        assert all([int((await h.store.record(r))["attempts"]) <= 2 for r in rids])
        assert workers.prefillers[1].batches


async def test_a_request_claimed_by_a_scheduler_that_died_comes_back_when_its_lease_expires(url, prefix):
    async with harness(url, prefix) as h:
        await h.submit(spec("r"))
        await h.store.claim([("r", "decode-0")], "prefill-0", lease_ms=200)  # as if by a scheduler that died
        assert await h.state("r") == "PREFILLING"
        await h.start_workers()
        await ended(h, ["r"])
        assert (await h.store.record("r"))["attempts"] == "2"


async def _in_state(h, rid, state):
    return await h.state(rid) == state


async def _all_in_state(h, rids, state):
    return all([await h.state(r) == state for r in rids])


async def _true(value):
    return value

