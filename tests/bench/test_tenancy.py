"""A spawned cluster's key file (one key per tenant, read by the real gateway parser); CPU probes."""

import os
import stat
import time

from gateway.auth import KeyRing
from pdq.bench.procstat import CpuProbe, cpu_seconds
from pdq.bench.tenancy import write_auth_file
from pdq.bench.workload import Tenant


def test_key_file_gives_each_tenant_its_key_and_weight(tmp_path):
    path = tmp_path / "auth.json"
    tenants = (Tenant("flood", 1.0, 4.0), Tenant("premium", 2.0))
    keys = write_auth_file(path, tenants, {"premium": "given-key-123", "*": "ignored"})
    assert keys["premium"] == "given-key-123" and keys["flood"].startswith("pdq-bench-flood-")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    ring = KeyRing.from_file(path)
    assert ring.tenants == {"flood": {"weight": 1.0}, "premium": {"weight": 2.0}}
    assert {p.tenant for p in ring.by_digest.values()} == {"flood", "premium"}
    assert all(p.role == "client" for p in ring.by_digest.values())


def test_cpu_probe_sees_this_process_work():
    assert cpu_seconds(os.getpid()) > 0 and cpu_seconds(-1) is None
    probe = CpuProbe({"me": os.getpid(), "gone": -1})
    probe.start()
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    used = probe.stop()
    assert set(used) == {"me"} and used["me"] >= 0.03
