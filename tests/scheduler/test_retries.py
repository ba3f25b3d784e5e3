"""Retries that help, on a real Redis with a real scheduler and fake workers: a failed attempt goes
to another worker after a backoff; a worker whose hand-offs keep failing is quarantined, listed
as such, then released; attempts lost to infrastructure do not fail a request, failed ones do."""

import pytest

from gateway.operator import worker_info
from pdq.state.registry import ROLES, live_workers
from tests.scheduler.fakes import wait_for
from tests.scheduler.harness import ended, harness, spec, token_indices

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture
def url(redis_server):
    return redis_server.url


async def workers(h) -> dict:
    live = await live_workers(h.store, ROLES, h.config.worker_timeout_s)
    return {w.worker_id: w for role in ROLES for w in live[role]}


async def registered(h, n: int) -> None:
    async def all_there():
        return len(await workers(h)) == n
    await wait_for(all_there)


async def test_a_failed_attempt_goes_to_the_other_prefill_worker_after_its_backoff(url, prefix):
    async with harness(url, prefix, workers=dict(prefill=2, decode=1), retry_backoff_ms=300) as h:
        bad, good = h.workers.prefillers
        bad.failing = True
        await registered(h, 3)
        await h.submit(spec("r", max_tokens=6))
        await ended(h, ["r"])
        assert bad.batches == [["r"]] and good.batches == [["r"]]  # tried once on each, not again on the bad one
        assert good.received_ms[0] - bad.received_ms[0] >= 300  # held back for its backoff first
        rec = await h.store.record("r")
        assert (rec["attempts"], rec["failures"], rec.get("lost", "0")) == ("2", "1", "0")
        assert set(rec["avoid"].split()) == {"prefill-0", "decode-0"}  # decode-0 too, but it is the only one
        assert await token_indices(h, "r") == list(range(6))


async def test_a_worker_whose_hand_offs_keep_failing_is_quarantined_listed_and_released(url, prefix):
    async with harness(url, prefix, workers=dict(prefill=2, decode=2), retry_backoff_ms=20, quarantine_after=3,
                       quarantine_s=1.0) as h:
        bad, good = h.workers.prefillers
        bad.failing = True
        await registered(h, 4)
        await h.store.pause(tenant="acme")  # three requests, one batch: all on the first prefill worker
        rids = [f"r{k}" for k in range(3)]
        for rid in rids:
            await h.submit(spec(rid))
        await h.store.pause(tenant="acme", paused=False)
        await ended(h, rids)  # retried on the other prefill worker

        async def quarantined():
            w = (await workers(h))["prefill-0"]
            return w if w.quarantined_until_ms else None
        listed = await wait_for(quarantined)
        assert bad.batches == [rids]
        until = listed.quarantined_until_ms
        assert until > bad.received_ms[0] and "3 KV hand-offs in a row failed" in listed.quarantine_reason
        assert "checksum mismatch" in listed.quarantine_reason
        others = await workers(h)
        assert not any(others[w].quarantined_until_ms for w in ("prefill-1", "decode-0", "decode-1"))

        bad.failing = False  # repaired: once its quarantine ends it gets work again
        n = 0

        async def bad_serves_again():
            nonlocal n
            n += 1
            await h.submit(spec(f"after{n}"))
            await ended(h, [f"after{n}"])
            return len(bad.batches) > 1
        await wait_for(bad_serves_again, timeout_s=30, every_s=0.05)
        assert bad.received_ms[1] >= until and bad.batches[1] == [f"after{n}"]
        served = {rid for batch in good.batches for rid in batch}
        assert {f"after{k}" for k in range(1, n)} <= served  # meanwhile, the other one served
        assert worker_info((await workers(h))["prefill-0"]).quarantined_until_ms == 0  # no longer shown


async def test_when_failed_attempts_are_spent_the_request_fails_with_the_last_error(url, prefix):
    async with harness(url, prefix, workers=dict(prefill=1, decode=1), max_attempts=2, retry_backoff_ms=10) as h:
        h.workers.prefillers[0].failing = True
        await h.submit(spec("r"))
        await ended(h, ["r"], ("FAILED",))
        rec = await h.store.record("r")
        assert (rec["attempts"], rec["failures"]) == ("2", "2")
        assert rec["error"].startswith("KV hand-off to ") and "checksum mismatch" in rec["error"]
        # every failure was between the same two workers: neither can be blamed, nobody is quarantined
        assert not any(w.quarantined_until_ms for w in (await workers(h)).values())


async def test_attempts_lost_to_a_dead_worker_do_not_fail_a_request(url, prefix):
    async with harness(url, prefix, workers=dict(decode=1, slots=1, step_s=0.01), max_attempts=1) as h:
        await h.submit(spec("r", max_tokens=200))

        async def decoding():
            return await h.state("r") == "DECODING"
        await wait_for(decoding)
        await next(iter(h.workers.decoders.values())).kill()

        async def lost():
            rec = await h.store.record("r")
            return rec if rec.get("lost") == "1" else None
        rec = await wait_for(lost, timeout_s=20)
        assert rec["state"] == "QUEUED" and "stopped heartbeating" in rec["error"]  # max_attempts=1, yet not FAILED
        await h.workers.add_decode()
        await ended(h, ["r"])
        rec = await h.store.record("r")
        assert (rec["attempts"], rec["lost"], rec.get("failures", "0")) == ("2", "1", "0")
        assert await token_indices(h, "r") == list(range(200))
