"""The engine core driven as a worker drives it: schedule(), a forward, update() with tokens the test
makes up (no sampling), one Sequence with one status each; preemption by priority; the request-level
strategies as core policies, with length bucketing."""

import pytest

from pdq.engine import SamplingParams
from pdq.engine.batch_policy import BatchPolicy
from pdq.engine.batching import Strategy
from pdq.engine.core import EngineCore
from pdq.engine.runner import PrefillItem
from pdq.engine.sequence import Sequence, SeqStatus


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def seq(seq_id, prompt_len: int, max_tokens: int, priority=(), first_token: int = 1) -> Sequence:
    return Sequence(seq_id, [first_token + i % 50 for i in range(prompt_len)],
                    SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), priority=priority)


def run_step(core: EngineCore, token: int = 7):
    """One step as a worker runs it: the forward on the plan, then made-up tokens for the rows sampled."""
    plan = core.schedule()
    if plan:
        core.runner.step(*plan.items())
    return plan, core.update(plan, [token] * len(plan.sample_rows))


def test_a_sequence_goes_waiting_running_finished_and_gives_its_blocks_back(tiny_llama, make_runner):
    runner = make_runner(tiny_llama, slots=2)
    core = EngineCore(runner, BatchPolicy(max_batched_tokens=16, prefill_chunk=8))
    s = seq("a", prompt_len=20, max_tokens=3)
    core.add(s)
    assert s.status == SeqStatus.WAITING
    plan, out = run_step(core)
    assert s.status == SeqStatus.RUNNING and [c.length for c in plan.prefill] == [8] and out == []  # a chunk only
    run_step(core)
    plan, out = run_step(core)  # the prompt's last 4 tokens: its first token is sampled
    assert [c.length for c in plan.prefill] == [4] and [o.token for o in out] == [7]
    plan, out = run_step(core, token=9)
    assert [r.seq_id for r in plan.decode] == ["a"] and plan.items()[1] == [("a", 7, 20)]
    plan, out = run_step(core, token=11)
    assert out[0].finish_reason == "length" and s.output == [7, 9, 11]
    assert s.status == SeqStatus.FINISHED and not core.has_unfinished()
    assert runner.free_tokens == runner.capacity_tokens


def test_finish_from_outside_ends_a_running_or_waiting_sequence_and_frees_its_blocks(tiny_llama, make_runner):
    runner = make_runner(tiny_llama, slots=2)
    core = EngineCore(runner, BatchPolicy(max_batched_tokens=64, prefill_chunk=64, max_num_seqs=1))
    a, b = seq("a", 10, 50), seq("b", 10, 50)
    core.add(a)
    core.add(b)
    plan, _ = run_step(core)
    assert a.status == SeqStatus.RUNNING and b.status == SeqStatus.WAITING  # one seat
    assert core.finish("a", "cancelled") is a and a.finish_reason == "cancelled"
    assert core.finish("a", "cancelled") is None  # once
    plan, out = run_step(core)
    assert b.status == SeqStatus.RUNNING and [o.seq.seq_id for o in out] == ["b"]
    core.finish("b", "stop")
    assert runner.free_tokens == runner.capacity_tokens and not core.has_unfinished()


@pytest.mark.parametrize("requeue", [True, False])
def test_when_blocks_run_out_the_least_important_sequence_is_preempted_not_the_newest(tiny_llama, make_runner,
                                                                                      requeue):
    # 2 x 128 positions in blocks of 16: three sequences of 40-token prompts growing by a token a step
    runner = make_runner(tiny_llama, slots=2, block_size=16)
    core = EngineCore(runner, BatchPolicy(max_batched_tokens=256, prefill_chunk=256), requeue_preempted=requeue)
    batch, interactive, batch2 = seq("batch", 40, 80, priority=(1,)), seq("int", 40, 80, priority=(0,)), \
        seq("batch2", 40, 80, priority=(1,))
    for s in (batch, interactive, batch2):
        core.add(s)
    preempted = []
    for _ in range(80):
        plan, _ = run_step(core)
        preempted += plan.preempted
        if preempted:
            break
    assert preempted and all(p.priority == (1,) for p in preempted)
    assert interactive.status == SeqStatus.RUNNING
    assert preempted[0] is batch2  # of equal priority, the newest goes first
    victim = preempted[0]
    assert victim.status == SeqStatus.WAITING and victim.num_cached == 0 and victim.output  # its tokens are kept
    assert (victim in core.waiting) == requeue  # back in line, or out to the caller to place elsewhere
    if requeue:
        while core.has_unfinished():
            run_step(core)
        assert len(victim.output) == 80 and runner.free_tokens == runner.capacity_tokens


def test_a_static_batch_starts_full_or_at_its_flush_time_and_nothing_joins_until_it_ends(tiny_llama, make_runner):
    clock = Clock()
    runner = make_runner(tiny_llama, slots=4)
    core = EngineCore(runner, BatchPolicy(max_batched_tokens=64, prefill_chunk=32),
                      Strategy("static", batch_size=3, flush_ms=1000), clock=clock)
    for i in range(2):
        core.add(seq(i, 5, 4 + 4 * i))
    plan, _ = run_step(core)
    assert not plan and core.wait_hint_s() == 1.0  # 2 of 3 wait for the flush time
    core.add(seq(2, 5, 4))
    core.add(seq(3, 5, 4))
    plan, _ = run_step(core)
    assert sorted(c.seq.seq_id for c in plan.prefill) == [0, 1, 2]  # a full batch, in arrival order
    batch = [core.running[i] for i in (0, 1, 2)]
    steps = 1
    while any(s.status is SeqStatus.RUNNING for s in batch):
        plan, _ = run_step(core)
        assert 3 not in core.running  # it waits for the whole batch to end
        assert sorted(s.seq_id for s in plan.decode) == [0, 1, 2]  # the finished keep their seats and rows
        steps += 1
    assert steps == 8  # the longest of the batch (8 tokens)
    assert core.padded == 8 and [len(s.output) for s in batch] == [4, 8, 4]  # 4 + 4 rows thrown away
    assert [s.finish_reason for s in batch] == ["length"] * 3
    assert core.release_seats() == batch and runner.free_tokens == runner.capacity_tokens
    clock.t = 5.0
    plan, _ = run_step(core)
    assert [c.seq.seq_id for c in plan.prefill] == [3]  # alone, once its flush time passed


def test_length_bucketing_batches_the_oldest_with_those_nearest_to_it_in_length():
    s = Strategy("dynamic", batch_size=3, bucket=True)
    assert s.pick([100, 10, 95, 12, 300, 101], 3) == [0, 2, 5]
    assert s.pick([100, 10], 3) == [0, 1]
    assert Strategy("dynamic", batch_size=3).pick([100, 10, 95, 12], 3) == [0, 1, 2]  # off: arrival order
    assert Strategy("continuous", bucket=True).pick([100, 10, 95], 2) == [0, 1]  # iteration-level: no batches


def test_a_bucketed_dynamic_batch_in_the_core_holds_similar_lengths(tiny_llama, make_runner):
    clock = Clock()
    runner = make_runner(tiny_llama, slots=4)
    core = EngineCore(runner, BatchPolicy(max_batched_tokens=128, prefill_chunk=64),
                      Strategy("dynamic", batch_size=2, window_ms=10, bucket=True), clock=clock)
    for i, max_tokens in enumerate([30, 3, 28, 4]):
        core.add(seq(i, 5, max_tokens))
    plan, _ = run_step(core)
    assert sorted(c.seq.seq_id for c in plan.prefill) == [0, 2]  # the oldest (35) and the nearest (33)
    first = [core.running[0], core.running[2]]
    while any(s.status is SeqStatus.RUNNING for s in first):
        run_step(core)
    plan, _ = run_step(core)  # the finished batch gives up its seats; the next one starts
    assert sorted(c.seq.seq_id for c in plan.prefill) == [1, 3]


def prefilled(runner, seq_id, prompt_len: int, max_tokens: int, priority=()) -> Sequence:
    """A sequence as a decode worker gets it: its prompt's K/V written into the pool (a hand-off
    received) and its first token sampled elsewhere."""
    s = seq(seq_id, prompt_len, max_tokens, priority)
    runner.allocate(seq_id, s.prompt)
    runner.step([PrefillItem(seq_id, s.prompt, 0)], [])
    s.output.append(5)
    s.num_cached = prompt_len
    return s


def test_a_prefilled_sequence_joins_with_its_blocks_and_decodes_without_a_prefill(tiny_llama, make_runner):
    runner = make_runner(tiny_llama, slots=2, block_size=16)
    core = EngineCore(runner, BatchPolicy(max_batched_tokens=64, prefill_chunk=8))
    s = prefilled(runner, "h", 20, 4)
    core.add_prefilled(s)
    plan, out = run_step(core)
    assert not plan.prefill and plan.items()[1] == [("h", 5, 20)]  # its first token, fed at position 20
    assert [o.token for o in out] == [7] and s.output == [5, 7]
    while core.has_unfinished():
        run_step(core)
    assert s.finish_reason == "length" and len(s.output) == 4 and runner.free_tokens == runner.capacity_tokens
    with pytest.raises(ValueError, match="positions cached"):
        core.add_prefilled(seq("x", 4, 4))  # nothing cached: not a hand-off


def test_reserved_blocks_are_left_alone_and_the_callers_victim_rule_chooses(tiny_llama, make_runner):
    """A decode worker's core: blocks promised to hand-offs on their way are out of reach (a
    sequence that needs one preempts instead), the victim is the caller's rule, and preempted
    sequences go out to the caller."""
    runner = make_runner(tiny_llama, slots=2, block_size=16)  # 16 blocks
    reserved = [0]
    chosen = []

    def victim(running):
        chosen.append([s.seq_id for s in running])
        return min(running, key=lambda s: s.seq_id)  # the caller's rule: here, the smallest id

    core = EngineCore(runner, BatchPolicy(max_batched_tokens=64), requeue_preempted=False, victim=victim,
                      reserved_blocks=lambda: reserved[0])
    a, b = prefilled(runner, "a", 32, 40), prefilled(runner, "b", 32, 40)  # 2 full blocks each
    core.add_prefilled(a)
    core.add_prefilled(b)
    reserved[0] = runner.free_blocks - 2  # two blocks left to take: one each for position 32
    plan, _ = run_step(core)
    assert [s.seq_id for s in plan.decode] == ["a", "b"] and not plan.preempted and not chosen
    reserved[0] = runner.free_blocks - 1  # one left: at position 48 a takes it, and b needs one too
    for _ in range(16):
        plan, _ = run_step(core)
        if plan.preempted:
            break
    assert chosen == [["a", "b"]] and [s.seq_id for s in plan.preempted] == ["a"]  # the caller's rule picked a
    assert a.status == SeqStatus.WAITING and a not in core.waiting and "a" not in core.running  # out to the caller
    assert [s.seq_id for s in plan.decode] == ["b"] and b.num_cached == 49
    reserved[0] = 0
    while core.has_unfinished():
        run_step(core)
    assert b.finish_reason == "length" and runner.free_tokens == runner.capacity_tokens


def test_urgent_first_runs_only_the_most_urgent_prompts_unless_none_of_them_can_run(tiny_llama, make_runner):
    """A prefill worker's core: prompts wait in priority order and a step's chunks go only to the
    most urgent priority with a prompt to run, so an urgent prompt's pass is not made longer by
    a flood's chunks; when none of the most urgent can be admitted, the others go on."""
    runner = make_runner(tiny_llama, slots=2, block_size=16)  # 16 blocks of 16
    core = EngineCore(runner, BatchPolicy(max_batched_tokens=256, prefill_chunk=64), urgent_first=True, alone=False)
    flood = [seq(f"f{i}", 40, 4, priority=(2,), first_token=100 + 50 * i) for i in range(3)]  # no shared prefix
    urgent = [seq("u0", 30, 4, priority=(0,)), seq("u1", 20, 4, priority=(0,), first_token=60)]
    for s in flood[:2] + urgent[:1] + flood[2:] + urgent[1:]:
        core.add(s)
    assert [s.seq_id for s in core.waiting] == ["u0", "u1", "f0", "f1", "f2"]  # by priority, then arrival
    plan = core.schedule()
    assert [(c.seq.seq_id, c.length) for c in plan.prefill] == [("u0", 30), ("u1", 20)]  # the budget left: unused
    core.update(plan, [7, 7])
    for s in urgent:
        core.detach(s.seq_id)  # handed off with their blocks
        runner.free(s.seq_id)
    big = seq("big", 100, 4, priority=(0,), first_token=30)  # urgent, but 7 blocks: more than are free
    runner.allocate("h1", [5] * 120)  # 10 of 16 blocks held elsewhere (a decode core's)
    runner.allocate("h2", [6] * 32)
    core.add(big)
    plan = core.schedule()
    assert [c.seq.seq_id for c in plan.prefill] == ["f0", "f1"]  # the urgent one cannot run: the others go on
    assert core.waiting[0] is big and [s.seq_id for s in core.waiting] == ["big", "f2"]  # f2: no blocks left
