"""Dev API keys of a local `pdq up`: written at start, found by the CLI and the Python client,
so the two-command quickstart needs no key handling. Files are private to the user (0600)."""

import json
import os
import secrets
from pathlib import Path

LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


def dev_dir() -> Path:
    base = os.environ.get("PDQ_CACHE_DIR") or str(Path.home() / ".cache" / "pdq")
    return Path(base) / "up"


def _write_private(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)


def write_dev_keys(port: int) -> tuple[Path, str, str]:
    """Creates a client key (tenant "default") and an admin key (tenant "ops") for the cluster
    on `port`. -> (auth file for the gateway, client key, admin key)."""
    client_key = "pdq-dev-" + secrets.token_urlsafe(18)
    admin_key = "pdq-admin-" + secrets.token_urlsafe(18)
    auth_file = dev_dir() / f"{port}.auth.json"
    _write_private(auth_file, {"keys": [{"key": client_key, "tenant": "default", "role": "client"},
                                        {"key": admin_key, "tenant": "ops", "role": "admin"}]})
    _write_private(dev_dir() / f"{port}.json", {"port": port, "client_key": client_key, "admin_key": admin_key})
    return auth_file, client_key, admin_key


def remove_dev_keys(port: int) -> None:
    for name in (f"{port}.auth.json", f"{port}.json"):
        (dev_dir() / name).unlink(missing_ok=True)


def find_dev_key(target: str, admin: bool = False) -> str | None:
    """The dev key of a local `pdq up` serving `target` (host:port), if there is one."""
    host, _, port = target.rpartition(":")
    if host not in LOCAL_HOSTS or not port.isdigit():
        return None
    try:
        data = json.loads((dev_dir() / f"{port}.json").read_text())
    except (OSError, ValueError):
        return None
    return data.get("admin_key" if admin else "client_key")
