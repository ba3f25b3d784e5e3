"""API keys for the workload's tenants on a spawned cluster.

Tenancy comes from the API key (gateway/auth.py), so a spawned cluster gets a key file of its
own: one client key per tenant of the workload, with the tenant's weight as its policy. Each
tenant's requests then carry that tenant's key, and the server sees the tenants the workload
defines. The file is private (0600) and lives as long as the benchmark.
"""

import json
import os
import secrets
from pathlib import Path

from pdq.bench.workload import Tenant


def write_auth_file(path: Path, tenants: tuple[Tenant, ...], given: dict[str, str] | None = None) -> dict[str, str]:
    """Writes the gateway key file at `path`; returns tenant -> key. A tenant's key is the one
    in `given` (e.g. from --tenant-key) or a fresh random one."""
    given = given or {}
    keys = {t.name: given.get(t.name) or f"pdq-bench-{t.name}-{secrets.token_urlsafe(12)}" for t in tenants}
    doc = {"keys": [{"key": key, "tenant": name, "role": "client"} for name, key in keys.items()],
           "tenants": {t.name: {"weight": t.weight} for t in tenants}}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=2)
    return keys
