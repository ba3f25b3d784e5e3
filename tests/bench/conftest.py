"""Factories for benchmark tests: records with hand-written timestamps, a fake gateway."""

from pdq.bench.arrivals import Arrivals
from pdq.bench.record import RequestRecord, RunRecord
from pdq.bench.workload import BenchRequest, Tenant, Workload


def make_record(due: float, token_times: list[float], end: float | None = None, *, tenant: str = "default",
                kind: str = "", max_tokens: int | None = None, error: str = "") -> RequestRecord:
    req = BenchRequest(0, (5, 6, 7), len(token_times) if max_tokens is None else max_tokens, tenant, kind)
    end = (token_times[-1] if token_times else due) if end is None else end
    return RequestRecord(req, due, list(token_times), end, "length" if not error else "", error)


def make_run(records: list[RequestRecord], name: str = "continuous", tenants=(Tenant("default"),),
             arrivals: Arrivals = Arrivals(), client_cpu_s: float | None = None) -> RunRecord:
    workload = Workload("mixed", 0, tuple(r.request for r in records), tuple(tenants))
    return RunRecord(name, name, workload, arrivals, records, client_cpu_s=client_cpu_s)
