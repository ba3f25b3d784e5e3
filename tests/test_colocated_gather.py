"""An idle colocated worker's first forward pass waits for the batches the scheduler says are
coming (PrefillBatch.more_coming), within its gather window, until they fill the pass; a lone
request never waits. Pure policy of `ColocatedLoop._gather`, with a scripted inbox."""

import queue
from types import SimpleNamespace

from decode_worker.colocated import ColocatedLoop
from pdq.v1 import internal_pb2 as pb
from prefill_worker.loop import Job

STEP_TOKENS = 64


class ScriptedInbox(queue.Queue):
    """Each blocking get hands out the next item of the script (Empty when none is left, as a
    wait that timed out), recording its timeout; get_nowait finds nothing more."""

    def __init__(self, script):
        super().__init__()
        self.script = list(script)
        self.waits = []

    def get(self, block=True, timeout=None):
        if not block:
            raise queue.Empty
        self.waits.append(timeout)
        if not self.script:
            raise queue.Empty
        return self.script.pop(0)

    def get_nowait(self):
        raise queue.Empty


def colocated(script, gather_ms=100.0) -> ColocatedLoop:
    runner = object()
    loop = ColocatedLoop(SimpleNamespace(runner=runner), SimpleNamespace(runner=runner), STEP_TOKENS, gather_ms)
    loop.inbox = ScriptedInbox(script)
    return loop


def job(rid: str, prompt_tokens: int, more_coming: bool) -> Job:
    spec = pb.RequestSpec(request_id=rid, prompt_token_ids=[1] * prompt_tokens)
    return Job(pb.PrefillItem(spec=spec), done=lambda outcome: None, more_coming=more_coming)


def pending(loop: ColocatedLoop) -> list[str]:
    return [j.rid for j in loop.pending]


def test_a_lone_request_starts_at_once():
    loop = colocated([job("b", 8, False)])
    loop._take(job("a", 8, more_coming=False))
    assert loop._gather()
    assert pending(loop) == ["a"] and loop.inbox.waits == []


def test_the_batches_said_to_be_coming_are_taken_until_one_says_it_is_the_last():
    loop = colocated([job("b", 8, True), job("c", 8, False), job("d", 8, False)])
    loop._take(job("a", 8, more_coming=True))
    assert loop._gather()
    assert pending(loop) == ["a", "b", "c"]  # d is for the pass after
    assert len(loop.inbox.waits) == 2 and all(0 < w <= 0.1 for w in loop.inbox.waits)


def test_prompts_that_fill_the_pass_do_not_wait_for_more():
    loop = colocated([job("c", 8, True)])
    loop._take(job("a", STEP_TOKENS // 2, more_coming=True))
    loop.inbox.script.insert(0, job("b", STEP_TOKENS // 2, True))
    assert loop._gather()
    assert pending(loop) == ["a", "b"]  # full: c waits for the next pass


def test_a_batch_that_does_not_come_ends_the_wait():
    loop = colocated([])
    loop._take(job("a", 8, more_coming=True))
    assert loop._gather()
    assert pending(loop) == ["a"] and len(loop.inbox.waits) == 1


def test_no_window_no_wait():
    loop = colocated([job("b", 8, False)], gather_ms=0)
    loop._take(job("a", 8, more_coming=True))
    assert loop._gather()
    assert pending(loop) == ["a"]


def test_a_stop_during_the_wait_stops_the_loop():
    loop = colocated([None])
    loop._take(job("a", 8, more_coming=True))
    assert not loop._gather()


def test_a_sequence_waiting_to_join_does_not_let_the_loop_sleep():
    """A hand-off taken on the model thread after a pass leaves its sequence waiting, with nothing
    running or pending: the next take must not block (continuous), and an empty loop blocks
    until something comes (or its liveness beat is due)."""
    import types

    from decode_worker.loop import DecodeLoop
    from pdq.engine import SamplingParams
    from pdq.engine.batching import Strategy
    from pdq.engine.core import EngineCore
    from pdq.engine.sequence import Sequence
    from pdq.engine.worker import IDLE_BEAT_S

    loop = colocated([])
    core = EngineCore(None, strategy=Strategy("continuous", flush_ms=2000))  # type: ignore[arg-type]
    decode = SimpleNamespace(running=core.running, core=core)
    decode._idle_timeout = types.MethodType(DecodeLoop._idle_timeout, decode)
    loop.decode = decode
    assert loop._wait_s() == IDLE_BEAT_S  # nothing at all
    core.add(Sequence("r", [1, 2, 3], SamplingParams(max_tokens=4)))
    assert loop._wait_s() <= 0.001
    core.strategy = Strategy("dynamic", window_ms=50)  # a window to wait out, no longer
    assert 0 < loop._wait_s() <= 0.05
