"""The chaos report: counts from the records, cancels by the phase they hit, percentiles, logged
errors, and a summary that names every check and its first violations."""

import json
from collections import Counter
from pathlib import Path

from pdq.chaos.check import CHECKS, Violation
from pdq.chaos.faults import Struck
from pdq.chaos.options import ChaosOptions
from pdq.chaos.plan import RequestPlan
from pdq.chaos.record import Outcome
from pdq.chaos.report import build, cancelled_in, log_errors, percentile, summary
from pdq.chaos.snapshot import Snapshot


def test_percentiles_are_nearest_rank():
    assert percentile([], 50) == 0.0
    assert percentile([3, 1, 2], 50) == 2 and percentile(list(range(1, 101)), 99) == 99


def test_a_cancel_is_placed_by_what_the_load_saw_else_by_the_records_timestamps():
    assert cancelled_in({"state": "CANCELLED"}) == "queued"
    assert cancelled_in({"state": "CANCELLED", "dispatched_ms": "1"}) == "prefill"
    assert cancelled_in({"state": "CANCELLED", "dispatched_ms": "1", "first_token_ms": "2"}) == "decode"
    decoding = {"state": "CANCELLED", "dispatched_ms": "1", "first_token_ms": "2"}
    assert cancelled_in(decoding, "TRANSFERRING") == "prefill"
    assert cancelled_in({"state": "COMPLETED"}, "DECODING") == "after its end (COMPLETED)"


def test_logged_errors_are_grouped_by_message_with_ids_blanked():
    log = ("2026-11-26 10:43:16,127 decode worker ERROR pdq.decode: decode step failed; requeueing 3 sequences\n"
           "2026-11-26 10:43:17,127 decode worker ERROR pdq.decode: decode step failed; requeueing 5 sequences\n"
           "2026-11-26 10:43:17,200 decode worker WARNING pdq.redis: Redis unreachable\n")
    assert log_errors({"decode-0": log, "gateway": ""}) == {
        "decode-0": {"ERROR pdq.decode: decode step failed; requeueing N sequences": 2}}


def test_the_result_counts_states_cancels_faults_and_statuses_and_the_summary_names_every_check(tmp_path):
    plans = [RequestPlan(i, f"c-{i}", "submit_get", 0, 4, "none", 0, cancel="queued" if i == 1 else "")
             for i in range(3)]
    outs = [Outcome(0, "c-0", rids=["a"], t_start=1.0, t_first_token=1.1, t_end=1.5),
            Outcome(1, "c-1", rids=["b"], cancelled="rpc", t_start=1.0, t_end=1.2),
            Outcome(2, "c-2", not_accepted="UNKNOWN: boom", t_start=1.0, t_end=1.0)]
    snap = Snapshot(records={"a": {"state": "COMPLETED", "attempts": "1"},
                             "b": {"state": "CANCELLED", "attempts": "0"}})
    violations = [Violation("lost", "never accepted", ["c-2"], {"request_id": ""})]
    result = build(ChaosOptions(requests=3, cancels=1), plans, outs, snap,
                   [Struck("kill_gateway", "gateway", 1, 2.0, in_flight=2)],
                   Counter({("Submit", "OK"): 2, ("Submit", "UNKNOWN"): 1}), violations, 5.0, 9.0, tmp_path, [],
                   {"decode-0": "x decode worker ERROR pdq.decode: boom\n"})
    json.dumps(result)
    assert result["ok"] is False and result["checks"]["lost"] == {"ok": False, "violations": 1}
    assert set(result["checks"]) == set(CHECKS)
    r = result["requests"]
    assert r["accepted"] == 2 and r["by_state"] == {"CANCELLED": 1, "COMPLETED": 1, "NOT_ACCEPTED": 1}
    assert r["cancels"] == {"asked": 1, "by_how": {"rpc": 1}, "in_state": {"queued": 1}}
    assert r["attempts"] == {0: 1, 1: 1}
    assert result["latency_ms"]["e2e_p50"] == 500.0 and result["latency_ms"]["ttft_p50"] == 100.0
    assert result["faults"]["by_kind"] == {"kill_gateway": 1} and result["statuses"]["Submit UNKNOWN"] == 1
    text = summary(result, violations)
    assert text.startswith("pdq chaos: FAILED: 1 violation(s)")
    assert all(check in text for check in CHECKS)
    assert "      c-2: never accepted" in text and "decode-0: 1" in text and str(Path(tmp_path)) in text
