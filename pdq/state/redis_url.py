"""The Redis URLs pdq takes (`--redis-url`, `PDQ_REDIS_URL`, `pdq up --redis-url`), checked in one place.

- `redis://[[user]:password@]host[:port][/db]`, `rediss://...` (TLS), `unix:///path.sock[?db=N]`:
  one Redis server, as redis-py reads them.
- `redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]`: the primary of
  `service` as Redis Sentinel names it now, asked of the Sentinels listed (port 26379 when left
  out; IPv6 addresses in brackets). The user and password are the primary's and replicas'
  (`requirepass`); Sentinels that require one of their own (their `requirepass`) take
  `?sentinel_password=...` (and `&sentinel_username=...` for an ACL user). Other query options
  (`?socket_timeout=5`) are redis-py's, as for redis://.
- `rediss+sentinel://...`: the same over TLS, to the Sentinels and to the primary alike, with
  redis-py's `ssl_*` query options for both (`?ssl_ca_certs=/etc/pdq/ca.pem`, `ssl_certfile` and
  `ssl_keyfile` for a client certificate, `ssl_cert_reqs=none` to skip verification).
"""

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_TLS_SCHEME = "rediss+sentinel"
SENTINEL_PORT = 26379
SENTINEL_AUTH = ("sentinel_password", "sentinel_username")  # query options for the Sentinels themselves
SCHEMES = ("redis://", "rediss://", "unix://", f"{SENTINEL_SCHEME}://", f"{SENTINEL_TLS_SCHEME}://")


@dataclass(frozen=True)
class SentinelURL:
    sentinels: tuple[tuple[str, int], ...]  # (host, port) of each Sentinel, in the URL's order
    service: str  # the name the Sentinels monitor the primary under (`sentinel monitor <service> ...`)
    options: dict[str, Any] = field(default_factory=dict)  # db, username, password, query options: redis-py's
    sentinel_auth: dict[str, str] = field(default_factory=dict)  # username, password: the Sentinels' own
    tls: bool = False  # rediss+sentinel://: TLS to the Sentinels and the primary (`ssl_*` in `options`)

    @property
    def sentinel_options(self) -> dict[str, Any]:
        """What a client of the Sentinels themselves takes beyond its timeouts: their own
        credentials and, over TLS, the URL's `ssl_*` options."""
        tls = {"ssl": True, **{k: v for k, v in self.options.items() if k.startswith("ssl_")}} if self.tls else {}
        return {**self.sentinel_auth, **tls}


def check_redis_url(url: str) -> None:
    """Raises ValueError saying what is wrong with `url`, if anything."""
    if not url.startswith(SCHEMES):
        raise ValueError(f"redis_url must start with redis://, rediss://, unix://, {SENTINEL_SCHEME}:// or "
                         f"{SENTINEL_TLS_SCHEME}://, got {_redacted(url)!r}")
    parse_sentinel_url(url)


def parse_sentinel_url(url: str) -> SentinelURL | None:
    """The Sentinels and service of a redis+sentinel:// or rediss+sentinel:// URL (None for any
    other URL); ValueError if it is malformed."""
    parts = urlsplit(url)
    if parts.scheme not in (SENTINEL_SCHEME, SENTINEL_TLS_SCHEME):
        return None
    tls = parts.scheme == SENTINEL_TLS_SCHEME
    userinfo, _, hosts = parts.netloc.rpartition("@")
    sentinels = tuple(_address(h, url) for h in hosts.split(","))
    path = [unquote(p) for p in parts.path.split("/")[1:]]
    if not path or not path[0] or len(path) > 2:
        raise ValueError(f"a {parts.scheme} URL is {parts.scheme}://[[user]:password@]host[:port][,host[:port]"
                         f"...]/service[/db], got {_redacted(url)!r}")
    if len(path) == 2 and not path[1].isdigit():
        raise ValueError(f"the database of a {parts.scheme} URL is a number, got {path[1]!r}")
    from redis.connection import parse_url  # its reading of credentials, db and query options

    query = parse_qsl(parts.query, keep_blank_values=True)
    auth = {name.removeprefix("sentinel_"): value for name, value in query if name in SENTINEL_AUTH}
    rest = urlencode([(name, value) for name, value in query if name not in SENTINEL_AUTH])
    options = parse_url(f"{'rediss' if tls else 'redis'}://{userinfo + '@' if userinfo else ''}sentinel/"
                        f"{''.join(path[1:])}{'?' + rest if rest else ''}")
    options.pop("host", None)
    options.pop("connection_class", None)  # rediss: the pool picks the TLS one of its kind (sync or asyncio)
    return SentinelURL(sentinels, path[0], options, auth, tls)


def _address(text: str, url: str) -> tuple[str, int]:
    host, port = text, ""
    if text.startswith("["):  # [IPv6]:port
        host, _, rest = text[1:].partition("]")
        if rest and not rest.startswith(":"):
            host = ""
        port = rest[1:]
    elif ":" in text:
        host, _, port = text.rpartition(":")
    if not host or (port and not port.isdigit()) or not 0 < int(port or SENTINEL_PORT) < 65536:
        raise ValueError(f"a Sentinel address is host[:port], got {text!r} in {_redacted(url)!r}")
    return host, int(port or SENTINEL_PORT)


def _redacted(url: str) -> str:
    parts = urlsplit(url)
    shown = url.replace(f":{parts.password}@", ":***@") if parts.password else url
    return re.sub(r"([?&]sentinel_password=)[^&]+", r"\1***", shown)
