"""A decode step's bookkeeping as pure functions (`decode_worker.bookkeeping`): what a token
means for its sequence (`judge`: stop strings, EOS, max_tokens) and what is written now
(`writes`: stream intervals, ends); and which sequence gives its blocks back when they run out
(`memory_victim`). No Redis, no model."""

from decode_worker.bookkeeping import judge, writes
from decode_worker.loop import Sequence, memory_victim
from pdq.engine.core import StepOutput
from pdq.engine.sampling import SamplingParams
from pdq.engine.sequence import SeqStatus
from pdq.model.loader import resolve_model
from pdq.model.tokenizer import load_tokenizer
from pdq.model.output_text import TextOutput
from pdq.state.request import State

TOKENIZER = load_tokenizer(resolve_model("builtin:tiny"))
EOS = 1
A, B = (TOKENIZER.encode(c, add_special_tokens=False).ids[0] for c in "ab")


def seq(rid: str, interval: int = 1, max_tokens: int = 16, stop: tuple[str, ...] = ()) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, stop=stop)
    return Sequence(rid, [A] * 4, params, output=[A], num_cached=4, epoch=1, text=TextOutput(TOKENIZER, stop),
                    interval=interval)


def step(seqs, tokens, n):
    """What the engine core does with a step's tokens (append, judge), then the writes."""
    outputs = []
    for s, token in zip(seqs, tokens):
        s.output.append(token)
        outputs.append(StepOutput(s, token, judge(s, token, {EOS}, 2048)))
    return writes(outputs, {}, n)


def test_a_stream_interval_holds_tokens_until_a_multiple_of_it_then_writes_them_at_once():
    s = seq("r", interval=3)
    assert step([s], [A], 1).items == [] and step([s], [B], 2).items == []
    plan = step([s], [A], 3)
    assert [(i.index, i.token_id) for i in plan.items] == [(1, A), (2, B), (3, A)]
    assert plan.owners == [s, s, s] and s.held == [] and plan.live == [(s, "")]


def test_an_end_writes_the_held_tokens_at_once_with_the_final_state_and_its_reason():
    s = seq("r", interval=8)
    step([s], [A], 1)
    plan = step([s], [EOS], 2)
    assert [(i.token_id, i.final_state, i.finish_reason) for i in plan.items] == [(A, None, ""), (EOS, State.COMPLETED, "eos")]
    assert plan.owners == [None, None]  # its reply is not needed: it leaves
    assert plan.ended == [s]


def test_max_tokens_and_a_stop_string_end_a_sequence_and_the_others_go_on():
    short, stopped, going = seq("short", max_tokens=2), seq("stop", stop=("b",)), seq("going")
    plan = step([short, stopped, going], [A, B, A], 1)
    assert dict((s.rid, r) for s, r in plan.live) == {"short": "length", "stop": "stop", "going": ""}
    assert plan.ended == [short, stopped] and plan.owners == [None, None, going]


def test_when_blocks_run_out_the_lowest_tier_then_the_tenant_with_most_seats_then_the_newest_goes():
    def running(rid, tier, tenant, arrived):
        s = seq(rid)
        s.labels, s.arrived = (tier, tenant), arrived
        return s

    tiers = ("interactive", "batch")
    old_batch, new_top = running("old-batch", "batch", "acme", 1.0), running("new-top", "interactive", "acme", 9.0)
    assert memory_victim([old_batch, new_top], tiers) is old_batch  # tier first, however new
    hog = [running(f"hog-{i}", "interactive", "hog", float(i)) for i in range(3)]
    lone = running("lone", "interactive", "lone", 99.0)
    assert memory_victim(hog + [lone], tiers) is hog[2]  # the tenant holding most seats, its newest
    done = running("done", "batch", "acme", 100.0)
    done.status = SeqStatus.FINISHED
    assert memory_victim([done, lone], tiers) is lone and memory_victim([done], tiers) is None
    assert memory_victim([running("x", "unknown", "t", 0.0), lone], tiers).rid == "x"  # an unknown tier counts lowest
