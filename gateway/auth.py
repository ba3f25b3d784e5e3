"""API keys: `authorization: Bearer <key>` -> the caller's tenant and role.

The key file (`--auth-file`, YAML or JSON) is the only source of tenancy; a request body never
names its tenant. Format:

    keys:
      - {key: "sk-live-...", tenant: acme, role: client}    # role: client (default) or admin
      - {key: "sk-ops-...",  tenant: ops,  role: admin}
    tenants:                                                # optional per-tenant policy
      acme: {weight: 2.0, tier: interactive, max_queued: 100}

Without a key file the gateway runs open: every caller is tenant "default" with role admin
(for local development only; `pdq up` always writes a key file).
"""

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdq.transport.status import StatusError

ROLES = ("client", "admin")
OPEN_TENANT = "default"


@dataclass(frozen=True)
class Principal:
    tenant: str
    role: str

    @property
    def admin(self) -> bool:
        return self.role == "admin"


@dataclass(frozen=True)
class KeyRing:
    by_digest: dict[str, Principal] | None = None  # None = open mode
    tenants: dict[str, dict] = field(default_factory=dict)

    @property
    def open(self) -> bool:
        return self.by_digest is None

    @classmethod
    def from_file(cls, path: str | Path) -> "KeyRing":
        text = Path(path).read_text()
        if str(path).endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
        keys: dict[str, Principal] = {}
        for i, entry in enumerate(data.get("keys", [])):
            key, tenant, role = str(entry.get("key", "")), str(entry.get("tenant", "")), entry.get("role", "client")
            if len(key) < 8 or not tenant:
                raise ValueError(f"{path}: keys[{i}] needs a key of 8+ characters and a tenant")
            if role not in ROLES:
                raise ValueError(f"{path}: keys[{i}].role must be client or admin, got {role!r}")
            keys[_digest(key)] = Principal(tenant, role)
        tenants = dict(data.get("tenants", {}) or {})
        allowed = {"weight", "tier", "max_queued", "max_queued_tokens"}
        for name, policy in tenants.items():
            unknown = set(policy or {}) - allowed
            if unknown:
                raise ValueError(f"{path}: tenants.{name}: unknown field(s) {sorted(unknown)}; "
                                 f"use {sorted(allowed)}")
        return cls(keys, tenants)

    def authenticate(self, context: grpc.aio.ServicerContext) -> Principal:
        """-> the caller; StatusError(UNAUTHENTICATED) for a missing or unknown key."""
        if self.by_digest is None:
            return Principal(OPEN_TENANT, "admin")
        header = dict(context.invocation_metadata() or ()).get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise StatusError(grpc.StatusCode.UNAUTHENTICATED,
                              "missing API key: send metadata 'authorization: Bearer <key>'")
        principal = self.by_digest.get(_digest(key.strip()))
        if principal is None:
            raise StatusError(grpc.StatusCode.UNAUTHENTICATED, "unknown API key")
        return principal


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
