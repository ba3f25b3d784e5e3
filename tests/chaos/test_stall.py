"""The load's stall watch: no progress while requests are outstanding is a stall, and twice as long
gives the run up; progress, or nothing outstanding, is no stall."""

import asyncio

from pdq.chaos.load import Stall, monotonic_clock


async def test_no_progress_with_requests_outstanding_is_a_stall_and_then_gives_the_run_up():
    stall = Stall(monotonic_clock(), stall_s=0.3)
    aborted = []
    watch = asyncio.create_task(stall.watch(lambda: ["c-1", "c-0"], lambda: aborted.append(True)))
    try:
        await asyncio.wait_for(stall.aborted.wait(), timeout=10)
    finally:
        watch.cancel()
    assert aborted == [True]
    assert len(stall.stalls) == 1
    s = stall.stalls[0]
    assert s["aborted"] and s["outstanding"] == 2 and s["requests"] == ["c-0", "c-1"]
    assert s["to"] - s["from"] > 0.6


async def test_progress_or_an_idle_load_is_no_stall():
    clock = monotonic_clock()
    stall = Stall(clock, stall_s=0.3)
    outstanding = ["c-0"]
    watch = asyncio.create_task(stall.watch(lambda: outstanding, lambda: None))
    try:
        while clock() < 1.5:  # progress all along
            stall.tick()
            await asyncio.sleep(0.05)
        outstanding.clear()  # then nothing outstanding, and no progress
        while clock() < 2.5:
            await asyncio.sleep(0.1)
    finally:
        watch.cancel()
    assert stall.stalls == [] and not stall.aborted.is_set()
