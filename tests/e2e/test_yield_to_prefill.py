"""A decode worker sharing its cores with prefill spaces its steps while a request reserved on it
is being prefilled (`--yield-to-prefill-ms`), and decodes at full pace otherwise."""

import threading
import time

import pytest

from pdq.client import Client
from pdq.ops.up import Cluster

YIELD_MS = 300
HANDOFF_DELAY_MS = 1500  # every KV hand-off waits this long: a request stays "being prefilled"


@pytest.fixture(scope="module")
def slow_handoffs():
    env = {"PDQ_FAULTS": f"kv_delay_ms={HANDOFF_DELAY_MS}", "PDQ_YIELD_TO_PREFILL_MS": str(YIELD_MS)}
    with Cluster(model="builtin", port=0, auth=False, extra_env=env) as c:
        yield c


def stream_times(client: Client, prompt: str, max_tokens: int, times: list, started: threading.Event | None = None):
    messages = client.generate_stream(prompt, max_tokens=max_tokens, ignore_eos=True)
    next(messages)  # the header (request id), before any token
    for msg in messages:
        if msg.HasField("usage"):  # the end
            break
        times.append(time.monotonic())
        if started is not None and len(times) == 3:
            started.set()


def test_decode_steps_wait_for_prefill_and_only_then(slow_handoffs):
    with Client(slow_handoffs.target) as client:
        a_times: list[float] = []
        a_decoding = threading.Event()
        a = threading.Thread(target=stream_times, args=(client, "a long answer", 120, a_times, a_decoding))
        a.start()
        assert a_decoding.wait(60)  # A decodes: its hand-off is done
        b_times: list[float] = []
        stream_times(client, "a second prompt", 4, b_times)  # B: first token, then its delayed hand-off
        a.join(60)
    assert len(b_times) == 4 and len(a_times) == 120
    # While B's KV was on its way (between B's first and second token) B was reserved on the
    # decode worker and not yet there: A's steps were spaced YIELD_MS apart. Without the yield a
    # step of this model takes well under 100 ms, and A would have made dozens of tokens.
    window = (b_times[0], b_times[1])
    assert window[1] - window[0] >= HANDOFF_DELAY_MS / 1000 * 0.9
    during = [t for t in a_times if window[0] < t < window[1]]
    assert len(during) <= HANDOFF_DELAY_MS // YIELD_MS + 1
    # with nothing being prefilled, A runs at full pace again: its last tokens came close together
    tail = a_times[-20:]
    assert (tail[-1] - tail[0]) / (len(tail) - 1) < YIELD_MS / 1000 / 2
