"""The capacity sweep's rules (`pdq.bench.capacity_policy`): when latency broke, which rate
comes next, which step was best, and what the bottleneck was."""

import pytest

from pdq.bench.capacity_policy import Step, SweepPlan, best, bottleneck, next_rate, why_broken

PLAN = SweepPlan(max_tokens=8, start_rps=100, factor=2, refine=2, p99_ms=500, token_ms=10)


def step(rps: float, achieved: float | None = None, p99: float = 50.0, errors: int = 0) -> Step:
    s = Step(target_rps=rps, offered_rps=rps, achieved_rps=rps if achieved is None else achieved,
             tokens_per_s=8 * rps, p50_ms=p99 / 2, p99_ms=p99, requests=300, errors=errors)
    s.broke = why_broken(s, PLAN)
    return s


def test_a_step_breaks_on_errors_on_p99_past_the_bound_with_its_tokens_and_on_falling_behind():
    assert why_broken(step(100), PLAN) == ""
    assert why_broken(step(100, p99=570), PLAN) == ""  # 500 ms + 7 tokens after the first at 10 ms
    assert "p99" in why_broken(step(100, p99=571), PLAN)
    assert "failed" in why_broken(step(100, errors=1), PLAN)
    assert "completed 89/s" in why_broken(step(100, achieved=89), PLAN)
    assert why_broken(step(100, achieved=91), PLAN) == ""


def test_the_sweep_multiplies_until_a_step_breaks_then_bisects_between_best_and_broken():
    steps = [step(100), step(200), step(400, p99=900)]
    assert next_rate([], PLAN) == 100
    assert next_rate(steps[:2], PLAN) == 400
    assert next_rate(steps, PLAN) == pytest.approx((200 * 400) ** 0.5)
    steps.append(step(283))
    assert next_rate(steps, PLAN) == pytest.approx((283 * 400) ** 0.5)
    steps.append(step(336, p99=900))
    assert next_rate(steps, PLAN) is None  # refined twice
    assert best(steps).target_rps == 283


def test_the_sweep_stops_when_the_first_step_breaks_or_the_bracket_is_narrow_or_steps_run_out():
    assert next_rate([step(100, errors=3)], PLAN) is None
    assert next_rate([step(100), step(105, p99=900)], PLAN) is None
    assert next_rate([step(100 * 2 ** i) for i in range(PLAN.max_steps)], PLAN) is None
    assert best([step(100, errors=3)]) is None


def test_the_bottleneck_is_a_process_on_a_full_core_else_the_machine_else_none():
    assert bottleneck({"gateway": 97.0, "scheduler": 40.0}, cores=2).startswith("gateway (a full core")
    assert bottleneck({"gateway": 60.0, "scheduler": 60.0, "client": 55.0}, cores=2).startswith("the machine's 2 cores")
    assert bottleneck({"gateway": 30.0, "redis": 10.0}, cores=2).startswith("no process CPU-bound")


def test_pdqs_share_of_the_bare_grpc_ceiling_is_its_best_step_over_the_bare_servers():
    from pdq.bench.capacity import share_of_ceiling

    mine = {"best": {"requests_per_s": 200.0, "tokens_per_s": 1600.0}}
    bare = {"best": {"requests_per_s": 800.0, "tokens_per_s": 6400.0}}
    assert share_of_ceiling(mine, bare) == {"requests_per_s": 0.25, "tokens_per_s": 0.25}
    assert share_of_ceiling({"best": None}, bare) is None and share_of_ceiling(mine, {"best": None}) is None


def test_the_bare_grpc_server_answers_a_stream_with_the_messages_the_gateway_sends():
    """`pdq.bench.stream_ceiling` as a process: a first message, one message per token, then
    the finish reason with usage; anything else UNIMPLEMENTED."""
    import subprocess
    import sys

    import grpc

    from pdq.client import Client
    from pdq.ops.redis_server import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "pdq.bench.stream_ceiling", str(port)])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
        with Client(f"127.0.0.1:{port}") as client:
            msgs = list(client.generate_stream([5, 6, 7], max_tokens=4, timeout=30))
            with pytest.raises(grpc.RpcError) as err:
                client.submit([5], max_tokens=1, timeout=30)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.terminate()
        server.wait(10)
    assert len(msgs) == 6 and msgs[0].request_id and not msgs[0].HasField("index")
    assert [(m.index, list(m.token_ids)) for m in msgs[1:5]] == [(i, [m.token_id]) for i, m in enumerate(msgs[1:5])]
    assert msgs[-1].finish_reason and (msgs[-1].usage.prompt_tokens, msgs[-1].usage.completion_tokens) == (3, 4)


def test_the_ceiling_sweep_runs_the_same_plan_against_a_bare_server_and_reports_its_best_step():
    """`transport_ceiling` as `pdq bench --capacity` runs it after the cluster's sweeps: a
    short plan, the bare server spawned and stopped, every step's CPU of server and client."""
    import argparse

    from pdq.bench.capacity import transport_ceiling

    args = argparse.Namespace(control_policy="normal", client_policy="normal", warmup=1, capacity_prompt_tokens=4,
                              seed=0, stream_interval=1)
    plan = SweepPlan(max_tokens=4, start_rps=20, max_steps=2, refine=0, step_s=0.5, p99_ms=5000)
    (got,) = transport_ceiling([plan], args, vocab=[65, 66, 67], cores=2)
    # whether a step sustains depends on how busy the machine is (CI runs tests side by side),
    # so the test holds the report to its steps, not to a rate: every step ran and was measured,
    # and best / first_broken are the steps the rules pick
    steps = got["steps"]
    assert 1 <= len(steps) <= 2 and steps[0]["target_rps"] == 20
    for s in steps:
        assert s["requests"] > 0 and s["errors"] == 0 and s["offered_rps"] > 0 and s["achieved_rps"] > 0
        assert s["tokens_per_s"] > 0
        assert {"grpc-server", "client"} <= set(s["cpu_pct"])
    sustained = [s for s in steps if not s["broke"]]
    if sustained:
        assert got["best"]["requests_per_s"] == max(s["achieved_rps"] for s in sustained)
    else:
        assert got["best"] is None and got["first_broken"]["offered_rps"] == steps[0]["offered_rps"]
