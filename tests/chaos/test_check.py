"""The chaos checker on hand-made runs: each check passes a healthy request and names a broken one."""

import pytest

from pdq.chaos.check import check_leaks, check_logs, check_request, check_run, check_unasked, index_break, record_tokens
from pdq.chaos.cluster import Exit
from pdq.chaos.plan import RequestPlan
from pdq.chaos.record import Call, Move, Outcome
from pdq.chaos.snapshot import Leftovers, Snapshot

REF = [11, 12, 13, 14, 15, 16, 17, 18]
RID = "a" * 32


def plan(**kw) -> RequestPlan:
    base = dict(index=0, client_id="c-0", kind="stream", prompt=0, max_tokens=4, deadline="none", timeout_ms=0)
    return RequestPlan(**{**base, **kw})


def entries(tokens: list[int], per: int = 1, end: str | None = "COMPLETED") -> list[dict]:
    out = [{"i": str(i), "t": ",".join(map(str, tokens[i:i + per])), "x": "", "l": ""}
           for i in range(0, len(tokens), per)]
    if end:
        out.append({"done": end, "r": "length" if end == "COMPLETED" else "x", "e": "", "u": ""})
    return out


def completed(tokens=REF[:4], **rec) -> Snapshot:
    record = {"state": "COMPLETED", "n_out": str(len(tokens)), "finish_reason": "length", "attempts": "1",
              "deadline_ms": "0", "finished_ms": "1000", **rec}
    return Snapshot(records={RID: record}, outputs={RID: entries(tokens, end=record["state"])}, idem={"c-0": RID},
                    index=[RID])


def seen(tokens=REF[:4], **kw) -> Outcome:
    out = Outcome(0, "c-0", rids=[RID], messages=[[i, 1] for i in range(len(tokens))], tokens=list(tokens),
                  stream_end="LENGTH", end_state="COMPLETED", end_tokens=list(tokens))
    for k, v in kw.items():
        setattr(out, k, v)
    return out


def checks(found) -> list[str]:
    return [v.check for v in found]


def test_a_request_that_streamed_the_reference_and_ended_once_passes_every_check():
    assert check_request(plan(), seen(), completed(), REF) == []


def test_a_second_end_entry_breaks_ends_exactly_once():
    snap = completed()
    snap.outputs[RID].append({"done": "CANCELLED", "r": "cancelled", "e": "", "u": ""})
    found = check_request(plan(), seen(), snap, REF)
    assert checks(found) == ["ends_exactly_once"] and "2 end entries" in found[0].message


def test_an_end_entry_that_disagrees_with_the_record_or_the_client_is_named():
    snap = completed()
    snap.outputs[RID][-1]["done"] = "FAILED"
    assert "end entry says FAILED" in check_request(plan(), seen(), snap, REF)[0].message
    found = check_request(plan(), seen(end_state="CANCELLED"), completed(), REF)
    assert checks(found) == ["ends_exactly_once"] and "client learned CANCELLED" in found[0].message


def test_a_stream_that_finished_ok_for_a_cancelled_request_breaks_ends_exactly_once():
    snap = completed()
    snap.records[RID]["state"] = "CANCELLED"
    snap.outputs[RID][-1]["done"] = "CANCELLED"
    found = check_request(plan(), seen(end_state="CANCELLED", cancelled="rpc"), snap, REF)
    assert checks(found) == ["ends_exactly_once"] and "stream ended LENGTH" in found[0].message


def test_a_request_still_running_after_the_drain_is_lost():
    snap = completed(state="DECODING")
    snap.outputs[RID].pop()
    found = check_request(plan(), seen(end_state=""), snap, REF)
    assert checks(found) == ["lost"] and "DECODING" in found[0].message


def test_a_vanished_record_is_lost_and_a_refused_submit_is_named_with_its_error():
    snap = completed()
    del snap.records[RID]
    assert "lost" in checks(check_request(plan(), seen(), snap, REF))
    out = Outcome(0, "c-0", not_accepted="UNKNOWN boom")
    found = check_request(plan(), out, Snapshot(), REF)
    assert checks(found) == ["lost"] and found[0].message == "never accepted"
    found = check_request(plan(), out, Snapshot(idem={"c-0": RID}), REF)
    assert "no call returned its id" in found[0].message


def test_one_client_id_with_two_request_ids_or_two_creations_is_duplicated():
    found = check_request(plan(kind="submit_get"), seen(rids=[RID, "b" * 32], created=[True, False]), completed(), REF)
    assert checks(found) == ["duplicated"]
    found = check_request(plan(kind="submit_get"), seen(created=[True, True]), completed(), REF)
    assert checks(found) == ["duplicated"] and "2 time(s)" in found[0].message
    found = check_request(plan(kind="stream", duplicate=True), seen(created=[True]), completed(), REF)
    assert checks(found) == ["duplicated"] and "after GenerateStream" in found[0].message
    assert check_request(plan(kind="submit_get", duplicate=True), seen(created=[True, False]), completed(), REF) == []
    found = check_request(plan(), seen(echoed_id="c-9"), completed(), REF)
    assert checks(found) == ["duplicated"] and "'c-9'" in found[0].message
    assert check_request(plan(), seen(echoed_id="c-0"), completed(), REF) == []


def test_requests_in_redis_no_client_id_maps_to_are_duplicates():
    snap = completed()
    snap.index.append("e" * 32)
    found = check_unasked([plan()], [seen()], snap)
    assert checks(found) == ["duplicated"] and found[0].requests == ["e" * 32]
    assert check_unasked([plan()], [seen()], completed()) == []


def test_tokens_other_than_the_reference_are_garbled_in_redis_on_the_stream_and_in_getresult():
    bad = [11, 12, 99, 14]
    found = check_request(plan(), seen(tokens=bad), completed(tokens=bad), REF)
    assert set(checks(found)) == {"garbled"} and "at 2" in found[0].message
    found = check_request(plan(), seen(end_tokens=bad), completed(), REF)
    assert checks(found) == ["garbled"] and "GetResult" in found[0].message


def test_completed_with_fewer_tokens_than_asked_is_garbled_but_a_cancelled_prefix_is_not():
    found = check_request(plan(), seen(tokens=REF[:3], stream_end=""), completed(tokens=REF[:3]), REF)
    assert checks(found) == ["garbled"] and "3 of 4" in found[0].message
    snap = completed(tokens=REF[:2], state="CANCELLED")
    out = seen(tokens=REF[:2], stream_end="CANCELLED", end_state="CANCELLED", cancelled="rpc")
    assert check_request(plan(cancel="decode"), out, snap, REF) == []


def test_a_repeated_or_skipped_index_breaks_stream_indices_on_either_side():
    assert index_break([[0, 1], [1, 2], [3, 1]]) == ""
    assert index_break([[0, 1], [2, 1]]).startswith("gap")
    assert index_break([[0, 2], [1, 1]]).startswith("repeat")
    found = check_request(plan(), seen(messages=[[0, 1], [1, 1], [1, 1], [2, 1]]), completed(), REF)
    assert checks(found) == ["stream_indices"] and "repeat" in found[0].message
    snap = completed()
    snap.outputs[RID][2]["i"] = "3"
    assert "stream_indices" in checks(check_request(plan(), seen(), snap, REF))
    assert record_tokens(entries(REF[:5], per=2)) == (REF[:5], [[0, 2], [2, 2], [4, 1]])


def test_cancelled_without_a_cancel_from_the_load_is_unrequested():
    snap = completed(tokens=REF[:2], state="CANCELLED", error="by client disconnected")
    out = seen(tokens=REF[:2], stream_end="UNKNOWN", end_state="CANCELLED")
    found = check_request(plan(), out, snap, REF)
    assert "unrequested_cancel" in checks(found)
    for how in ("rpc", "disconnect", "abandon"):
        out.cancelled = how
        assert "unrequested_cancel" not in checks(check_request(plan(), out, snap, REF))


def test_timed_out_before_its_moved_deadline_or_without_one_is_unrequested():
    out = seen(tokens=REF[:2], stream_end="DEADLINE_EXCEEDED", end_state="TIMED_OUT",
               moves=[Move(1.0, 600_000, "OK", 601_000)])
    early = completed(tokens=REF[:2], state="TIMED_OUT", deadline_ms="601000", finished_ms="2000")
    found = check_request(plan(deadline="moved", timeout_ms=1500), out, early, REF)
    assert checks(found) == ["unrequested_timeout"] and "599000 ms before" in found[0].message
    due = completed(tokens=REF[:2], state="TIMED_OUT", deadline_ms="1500", finished_ms="1501")
    assert check_request(plan(deadline="tight", timeout_ms=300), out, due, REF) == []
    none = completed(tokens=REF[:2], state="TIMED_OUT", deadline_ms="0", finished_ms="1501")
    assert "without a deadline" in check_request(plan(), out, none, REF)[0].message


def test_unknown_and_internal_are_violations_and_so_is_a_status_the_situation_does_not_explain():
    calls = [Call("GetResult", "UNKNOWN", "Unexpected <class 'redis.exceptions.ConnectionError'>", 1.0),
             Call("Cancel", "INTERNAL", "boom", 2.0), Call("GetResult", "NOT_FOUND", "no request", 3.0),
             Call("Submit", "UNAVAILABLE", "scheduler unreachable", 4.0),
             Call("StreamResult", "CANCELLED", "closed by the load", 5.0, ours=True)]
    found = check_request(plan(), seen(calls=calls), completed(), REF)
    assert checks(found) == ["unknown_internal", "unknown_internal", "unexpected_status"]


def test_a_failed_request_and_a_given_up_one_are_violations():
    snap = completed(tokens=REF[:1], state="FAILED", error="KV hand-off: checksum", attempts="3")
    out = seen(tokens=REF[:1], stream_end="UNAVAILABLE", end_state="FAILED")
    found = check_request(plan(), out, snap, REF)
    assert checks(found) == ["failed"] and "3 attempt(s): KV hand-off: checksum" in found[0].message
    found = check_request(plan(), seen(abandoned="not ended 300s after it started"), completed(), REF)
    assert checks(found) == ["stall"]


def healthy_leftovers(**kw) -> Leftovers:
    worker = {"free_slots": "6", "capacity": "6", "running": "0", "reserved": "0", "kv_free_tokens": "4096",
              "kv_total_tokens": "4096", "heartbeat_ms": "10000"}
    base = dict(queues={"pdq:q:interactive:default": []}, load={"n": "0", "tokens": "0", "running": "0"},
                decode_workers={"chaos-decode-0": dict(worker), "chaos-decode-1": dict(worker)}, now_ms=10500)
    return Leftovers(**{**base, **kw})


def test_nothing_left_over_passes_the_leak_check():
    assert check_leaks(healthy_leftovers(), decode_workers=2) == []


@pytest.mark.parametrize("leftover, words", [
    (dict(queues={"pdq:q:interactive:default": ["x"]}), "queue pdq:q:interactive:default holds 1"),
    (dict(load={"n": "0", "tokens": "0", "running": "-1"}), "counters of load"),
    (dict(leases=["x"]), "p:leases holds 1"),
    (dict(held={"pdq:held:chaos-decode-0": ["x"]}), "held set"),
    (dict(deadlines={"x": "COMPLETED"}), "p:deadlines holds 1"),
    (dict(live={"pdq:live:default": ["x"]}), "live set"),
    (dict(depth={"pdq:depth:batch": {"n:default": "2"}}), "counters of pdq:depth:batch"),
])
def test_each_kind_of_leftover_is_a_leak(leftover, words):
    found = check_leaks(healthy_leftovers(**leftover), decode_workers=2)
    assert checks(found) == ["leaks"] and words in found[0].message


def test_a_held_seat_or_kv_block_or_a_silent_decode_worker_is_a_leak():
    left = healthy_leftovers()
    left.decode_workers["chaos-decode-1"]["reserved"] = "1"
    assert "1 seats held" in check_leaks(left, decode_workers=2)[0].message
    left = healthy_leftovers()
    left.decode_workers["chaos-decode-1"]["kv_free_tokens"] = "4080"
    assert "4080 of 4096 KV tokens free" in check_leaks(left, decode_workers=2)[0].message
    left = healthy_leftovers()
    left.decode_workers["chaos-decode-1"]["heartbeat_ms"] = "1000"
    assert "1 of 2 decode workers heartbeating" in check_leaks(left, decode_workers=2)[0].message


def test_the_whole_run_adds_stalls_exits_and_unhealed_faults():
    snap = completed()
    snap.state = healthy_leftovers()
    stall = {"from": 10.0, "to": 50.0, "outstanding": 3, "requests": ["c-0"], "aborted": True}
    found = check_run([plan()], [seen()], snap, [REF], [stall], [Exit("decode-0", 1, 12.0, "fatal")],
                      ["not SERVING"], decode_workers=2)
    assert checks(found) == ["stall", "process_exits", "heal"]
    assert "gave up" in found[0].message and "decode-0 exited with status 1" in found[1].message


def test_a_thread_that_died_in_a_roles_log_is_a_violation_and_a_handled_error_is_not():
    log = """2026 decode worker ERROR pdq.decode: decode step failed; requeueing its sequences
Traceback (most recent call last):
redis.exceptions.ConnectionError: Connection closed by server.
Exception in thread Thread-2:
Traceback (most recent call last):
  File "redis/client.py", line 1776, in run
redis.exceptions.ConnectionError: Connection closed by server.
"""
    found = check_logs({"decode-0": log, "gateway": "2026 gateway INFO pdq: serving"})
    assert checks(found) == ["thread_deaths"]
    assert found[0].message == ("decode-0: Exception in thread Thread-2: "
                                "redis.exceptions.ConnectionError: Connection closed by server.")
    assert found[0].evidence == {"log_line": 4}
