"""Admission rules of the batching strategies (pure)."""

import pytest

from pdq.engine.batching import Strategy


def test_continuous_admits_everything_at_once():
    s = Strategy("continuous")
    assert s.admit(waiting=5, running=7, oldest_wait_ms=0) == 5
    assert not s.run_to_completion


def test_dynamic_starts_on_size_or_window_and_never_joins_a_running_batch():
    s = Strategy("dynamic", batch_size=4, window_ms=50)
    assert s.admit(waiting=2, running=0, oldest_wait_ms=10) == 0
    assert s.admit(waiting=2, running=0, oldest_wait_ms=50) == 2
    assert s.admit(waiting=9, running=0, oldest_wait_ms=0) == 4
    assert s.admit(waiting=9, running=1, oldest_wait_ms=10_000) == 0
    assert s.wait_hint_ms(oldest_wait_ms=20) == 30


def test_static_waits_for_a_full_batch_until_the_flush_time():
    s = Strategy("static", batch_size=8, flush_ms=2000)
    assert s.admit(waiting=7, running=0, oldest_wait_ms=1999) == 0
    assert s.admit(waiting=8, running=0, oldest_wait_ms=0) == 8
    assert s.admit(waiting=3, running=0, oldest_wait_ms=2000) == 3
    assert s.run_to_completion


def test_unknown_strategy_is_rejected():
    with pytest.raises(ValueError, match="strategy must be one of"):
        Strategy("magic")


def test_continuous_never_hints_a_wait():
    """A sequence waiting under `continuous` is admitted at the next step: the loop must not sleep
    on it (a colocated worker once slept the static flush time, 2 s, before a lone request's
    first decode step)."""
    assert Strategy("continuous", flush_ms=2000).wait_hint_ms(oldest_wait_ms=0) == 0
