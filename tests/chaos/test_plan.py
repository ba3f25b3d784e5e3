"""The chaos plan is seeded, holds the asked-for faults and cancels, and spreads faults over the run."""

from collections import Counter

import pytest

from pdq.chaos.options import FULL, SHORT, ChaosOptions
from pdq.chaos.plan import FIRST, LAST, MOVED_MAX_TOKENS, longest, plan_faults, plan_requests, prompts
from pdq.cli import build_parser


def test_the_same_seed_gives_the_same_plan_and_another_seed_another():
    a, b = ChaosOptions(requests=300, seed=7), ChaosOptions(requests=300, seed=8)
    assert plan_requests(a) == plan_requests(a) and plan_faults(a) == plan_faults(a)
    assert plan_requests(a) != plan_requests(b) and plan_faults(a) != plan_faults(b)


def test_prompts_are_distinct_and_client_ids_unique():
    assert len(set(prompts())) == len(prompts()) == 32
    reqs = plan_requests(ChaosOptions(requests=500))
    assert len({r.client_id for r in reqs}) == 500


def test_the_goal_runs_faults_and_cancels_are_all_planned():
    opts = ChaosOptions()
    faults = Counter(f.kind for f in plan_faults(opts))
    assert faults == {"kill_prefill": 5, "kill_decode": 5, "kill_scheduler": 1, "kill_gateway": 1,
                      "redis_restart": 2, "conn_drop": 20, "kv_corrupt": 50}
    reqs = plan_requests(opts)
    assert len(reqs) == 5000
    assert Counter(r.cancel for r in reqs if r.cancel) == {"queued": 67, "prefill": 67, "decode": 66}
    assert all(r.kind != "stream" for r in reqs if r.cancel in ("queued", "prefill"))
    assert all(r.deadline == "none" for r in reqs if r.cancel)
    assert all(r.max_tokens == MOVED_MAX_TOKENS and 1000 <= r.timeout_ms < 2000 for r in reqs if r.deadline == "moved")
    assert all(r.max_tokens <= longest(r.prompt) for r in reqs)  # the reference covers every request
    assert {r.kind for r in reqs} == {"stream", "submit_get", "submit_stream"}
    assert {r.deadline for r in reqs} == {"none", "generous", "tight", "moved"}
    assert 300 < sum(r.duplicate for r in reqs) < 700


def test_faults_are_spread_over_the_run_in_trigger_order_with_redis_down_at_most_as_long_as_asked():
    opts = ChaosOptions(requests=1000, redis_down_s=3.0)
    faults = plan_faults(opts)
    triggers = [f.trigger for f in faults]
    assert triggers == sorted(triggers)
    assert FIRST * 1000 <= triggers[0] and triggers[-1] <= LAST * 1000
    gaps = [b - a for a, b in zip(triggers, triggers[1:])]
    assert max(gaps) < 3 * 1000 * (LAST - FIRST) / len(faults)  # evenly spread, with jitter
    assert all(0.5 <= f.delay_s <= 3.0 for f in faults if f.kind == "redis_restart")
    assert all(f.delay_s == 0 for f in faults if f.kind in ("conn_drop", "kv_corrupt"))


def test_flags_beat_the_preset_and_no_faults_turns_every_fault_off():
    parser = build_parser()
    opts = ChaosOptions.from_args(parser.parse_args(["chaos", "--short", "--requests", "99"]))
    assert opts.requests == 99 and opts.worker_kills == SHORT["worker_kills"]
    assert ChaosOptions.from_args(parser.parse_args(["chaos"])).requests == FULL["requests"]
    quiet = ChaosOptions.from_args(parser.parse_args(["chaos", "--short", "--no-faults", "--conn-drops", "1"]))
    assert quiet.faults == 1 and quiet.conn_drops == 1 and quiet.cancels == SHORT["cancels"]
    assert parser.parse_args(["chaos"]).func.__name__ == "_chaos"
    env = ChaosOptions.from_args(parser.parse_args(["chaos", "--env", "PDQ_MAX_ATTEMPTS=5", "--env", "A=b=c"])).env
    assert env == ("PDQ_MAX_ATTEMPTS=5", "A=b=c")


@pytest.mark.parametrize("bad", [dict(requests=0), dict(cancels=10, requests=5), dict(redis_down_s=40),
                                 dict(worker_kills=-1), dict(stall_s=0), dict(env=("NOEQUALS",))])
def test_bad_options_are_refused_with_the_flag_named(bad):
    with pytest.raises(ValueError, match="--"):
        ChaosOptions(**bad)
