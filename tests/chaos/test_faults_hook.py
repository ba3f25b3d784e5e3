"""PDQ_FAULTS=kv_corrupt_on_signal: each SIGUSR1 corrupts exactly one later KV hand-off, in this
process and in a real prefill worker."""

import os
import signal
import threading

import pytest
import redis

from pdq.client import Client
from pdq.ops.faults import Faults
from pdq.ops.up import Cluster
from tests.oracles import scrape, value

DATA = b"\x12" + b"payload"  # a data chunk (kv_transfer's KVChunk field 2), as kv_frames sees it
FRAMES = [b"\x0aheader", DATA, DATA]


@pytest.fixture
def usr1():
    before = signal.getsignal(signal.SIGUSR1)
    yield
    signal.signal(signal.SIGUSR1, before)


def corrupted(frames: list[bytes]) -> int:
    return sum(f != g for f, g in zip(frames, FRAMES))


def test_each_signal_arms_one_corrupt_hand_off_and_no_more(monkeypatch, usr1):
    monkeypatch.setenv("PDQ_FAULTS", "kv_corrupt_on_signal")
    faults = Faults.from_env()
    assert faults  # a prefill worker passes its frames through it
    assert corrupted(list(faults.kv_frames(iter(FRAMES)))) == 0
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert faults.get("kv_corrupt") == 2
    first, second, third = (list(faults.kv_frames(iter(FRAMES))) for _ in range(3))
    assert first[1] != DATA and first[2] == DATA  # one data chunk of the hand-off
    assert corrupted(second) == 1 and corrupted(third) == 0
    assert faults.get("kv_corrupt") == 0


def test_counted_corrupts_and_signalled_ones_add_up(usr1):
    faults = Faults("kv_corrupt=1,kv_corrupt_on_signal")
    assert faults.install_signal_handler()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert [corrupted(list(faults.kv_frames(iter(FRAMES)))) for _ in range(3)] == [1, 1, 0]


def test_off_the_main_thread_no_handler_is_installed(monkeypatch, usr1):
    monkeypatch.setenv("PDQ_FAULTS", "kv_corrupt_on_signal")
    before = signal.getsignal(signal.SIGUSR1)
    got = []
    thread = threading.Thread(target=lambda: got.append(Faults.from_env()))
    thread.start()
    thread.join()
    assert got[0] and signal.getsignal(signal.SIGUSR1) is before


def test_an_unknown_fault_is_refused_with_the_known_ones_listed():
    with pytest.raises(ValueError, match="kv_corrupt_on_signal"):
        Faults("kv_corupt_on_signal")


@pytest.fixture(scope="module")
def signalled():
    with Cluster(model="builtin:tiny", port=0, auth=False, extra_env={"PDQ_FAULTS": "kv_corrupt_on_signal"}) as c:
        yield c


def attempts(c: Cluster, rid: str) -> int:
    r = redis.Redis.from_url(c.redis_url)
    try:
        return int(r.hget(f"pdq:req:{rid}", "attempts"))
    finally:
        r.close()


def test_a_signalled_prefill_worker_corrupts_its_next_hand_off_once_and_keeps_serving(signalled):
    prefill = next(ch for ch in signalled.children if ch.name == "prefill-0")
    with Client(signalled.target) as c:
        before = c.generate("first", max_tokens=4, ignore_eos=True)
        assert attempts(signalled, before.request_id) == 1
        os.kill(prefill.process.pid, signal.SIGUSR1)
        hit = c.generate("first", max_tokens=4, ignore_eos=True)  # its hand-off fails; the retry's does not
        after = c.generate("first", max_tokens=4, ignore_eos=True)
    assert hit.token_ids == after.token_ids == before.token_ids
    assert attempts(signalled, hit.request_id) == 2 and attempts(signalled, after.request_id) == 1
    assert prefill.process.poll() is None
    samples = scrape(prefill.metrics_url(signalled.host))
    assert value(samples, "pdq_kv_transfer_seconds_count", outcome="error") == 1
    assert value(samples, "pdq_kv_transfer_seconds_count", outcome="ok") == 3
