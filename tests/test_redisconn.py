"""Redis clients of pdq processes (pdq.state.redisconn) against a real redis-server that is stopped and
restarted under them: commands ride through an outage shorter than the window, fail after a
longer one, and a bounded pool makes a burst of calls wait instead of failing. With a Sentinel
URL (pdq.state.redis_url) the clients follow a real failover (primary, replica, three Sentinels) to the
new primary."""

import asyncio
import re
import time

import pytest
import redis

from pdq.state import redisconn
from pdq.state.cancel_listener import CancelListener
from pdq.config import StoreConfig
from pdq.state.keys import Keys
from pdq.ops.redis_sentinel import SentinelGroup
from pdq.ops.redis_server import RedisServer, free_port
from pdq.state.redis_url import parse_sentinel_url


@pytest.fixture
def server():
    """A private redis-server on a fixed port, so it can be restarted under the same URL."""
    port = free_port()
    state = {"server": RedisServer(port=port).start()}

    def restart() -> None:
        state["server"].stop()
        state["server"] = RedisServer(port=port).start()

    state["restart"] = restart
    yield state
    state["server"].stop()


def test_a_sync_client_carries_on_after_redis_restarted(server):
    client = redisconn.connect(server["server"].url, outage_s=5)
    client.set("k", "v")
    server["restart"]()  # every pooled connection is now a dead socket
    assert client.get("k") is None  # a fresh server; no ConnectionError
    client.close()


async def test_an_async_client_carries_on_after_redis_restarted(server):
    client = redisconn.connect_async(server["server"].url, outage_s=5)
    await client.set("k", "v")
    server["restart"]()
    assert await client.get("k") is None
    await client.aclose()


async def test_an_outage_shorter_than_the_window_is_ridden_through(server):
    url = server["server"].url
    client = redisconn.connect_async(url, outage_s=10)
    await client.ping()
    server["server"].stop()
    port = server["server"].port
    loop = asyncio.get_running_loop()
    loop.call_later(0.8, lambda: server.__setitem__("server", RedisServer(port=port).start()))
    started = time.monotonic()
    assert await client.set("after", "1")  # waits for the server, then goes through
    assert time.monotonic() - started >= 0.7
    await client.aclose()


async def test_an_outage_longer_than_the_window_fails_the_command_after_it(server):
    client = redisconn.connect_async(server["server"].url, outage_s=0.5)
    await client.ping()
    server["server"].stop()
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError) as err:
        await client.get("k")
    waited = time.monotonic() - started
    assert 0.5 <= waited < 5
    assert redisconn.unavailable(err.value)
    await client.aclose()


def test_a_sync_outage_longer_than_the_window_fails_after_it(server):
    client = redisconn.connect(server["server"].url, outage_s=0.5)
    client.ping()
    server["server"].stop()
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        client.get("k")
    assert 0.5 <= time.monotonic() - started < 5


async def test_a_burst_larger_than_the_pool_waits_for_connections_instead_of_failing(server):
    client = redisconn.connect_async(server["server"].url, max_connections=2, outage_s=10)
    # each call holds its connection ~50 ms (a blocking pop that times out): 40 of them on 2 connections
    got = await asyncio.gather(*(client.blpop([f"empty-{i}"], timeout=0.05) for i in range(40)))
    assert got == [None] * 40
    info = await client.info("clients")
    assert info["connected_clients"] <= 2 + 1  # the pool's, and maybe one of the server's own
    await client.aclose()


async def test_a_burst_waits_for_busy_connections_longer_than_a_short_outage_window(server):
    """Waiting for a pooled connection is queueing, not Redis being unreachable: with a 0.5 s
    outage window, 40 calls holding one of 2 connections ~50 ms each (~1 s of queueing) all
    succeed instead of the last ones failing "No connection available"."""
    client = redisconn.connect_async(server["server"].url, max_connections=2, outage_s=0.5)
    started = time.monotonic()
    got = await asyncio.gather(*(client.blpop([f"empty-{i}"], timeout=0.05) for i in range(40)))
    assert got == [None] * 40 and time.monotonic() - started > 0.5  # queued past the outage window
    await client.aclose()


def test_only_connection_failures_count_as_unavailable():
    assert redisconn.unavailable(redis.ConnectionError("x"))
    assert redisconn.unavailable(redis.TimeoutError("x"))
    assert redisconn.unavailable(redis.BusyLoadingError("loading"))
    assert not redisconn.unavailable(redis.ResponseError("ERR bad script"))
    assert not redisconn.unavailable(ValueError("x"))


def test_a_sentinel_url_names_its_sentinels_service_database_and_password():
    url = parse_sentinel_url("redis+sentinel://:s%40cret@10.0.0.1:26380,sentinel-b,[::1]:5000/cache/3?socket_timeout=4")
    assert url.sentinels == (("10.0.0.1", 26380), ("sentinel-b", 26379), ("::1", 5000))
    assert url.service == "cache"
    assert (url.options["db"], url.options["password"], url.options["socket_timeout"]) == (3, "s@cret", 4.0)
    assert parse_sentinel_url("redis://127.0.0.1:6379/0") is None
    guarded = parse_sentinel_url("redis+sentinel://a:1/pdq?sentinel_password=p%26w&socket_timeout=2&sentinel_username=ops")
    assert guarded.sentinel_auth == {"password": "p&w", "username": "ops"}
    assert "password" not in guarded.options and guarded.options["socket_timeout"] == 2.0
    assert StoreConfig(redis_url="redis+sentinel://a:1,b:2/pdq").redis_url == "redis+sentinel://a:1,b:2/pdq"


@pytest.mark.parametrize("url, says", [
    ("http://127.0.0.1:6379", "must start with redis://, rediss://, unix://, redis+sentinel:// or rediss+sentinel://"),
    ("redis+sentinel://127.0.0.1:26379", "/service[/db]"),
    ("redis+sentinel://127.0.0.1:26379/pdq/zero", "is a number"),
    ("redis+sentinel://127.0.0.1:port/pdq", "host[:port], got '127.0.0.1:port'"),
    ("redis+sentinel://:hunter2@a:1,,b:2/pdq", "got '' in 'redis+sentinel://:***@a:1,,b:2/pdq'"),
    ("redis+sentinel://a:1,,b:2/pdq?sentinel_password=hunter2", "in 'redis+sentinel://a:1,,b:2/pdq?sentinel_password=***'"),
])
def test_a_malformed_redis_url_is_refused_saying_what_is_wrong_without_its_password(url, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        StoreConfig(redis_url=url)


async def test_clients_of_a_sentinel_url_follow_a_failover_of_the_primary_to_the_new_one(prefix):
    """The primary is SIGKILLed: a command sent meanwhile waits (it is retried under the outage
    window) and is answered by the replica the Sentinels promote; the pub/sub listener subscribes
    there again and hears what is published on it."""
    with SentinelGroup() as group:
        sync = redisconn.connect(group.url, outage_s=20)
        aio = redisconn.connect_async(group.url, outage_s=20)
        listener = CancelListener(group.url, Keys(prefix), outage_s=20)
        assert sync.set("before", "1") and await aio.get("before") == b"1"
        old = group.kill_primary()
        started = time.monotonic()
        assert await aio.set("during", "2")  # waits for the new primary
        assert sync.get("during") == b"2"
        new = group.wait_for_failover(old.port)
        assert time.monotonic() - started < 10
        assert group.replication(new)["role"] == "master"
        with redis.Redis(port=new.port) as direct:  # what the clients wrote went to the new primary
            assert direct.mget("before", "during") == [b"1", b"2"]
            while not (listener.subscribed.is_set() and listener.gaps == 1):
                await asyncio.sleep(0.02)
            direct.publish(Keys(prefix).cancel_channel, "r-1")
        while not listener.pop("r-1"):
            await asyncio.sleep(0.02)
        listener.close()
        sync.close()
        await aio.aclose()


def test_sentinels_that_require_a_password_of_their_own_are_asked_with_the_urls():
    with SentinelGroup(replicas=0, sentinels=1, quorum=1, sentinel_password="s3nt") as group:
        assert "sentinel_password=s3nt" in group.url
        with redisconn.connect(group.url, outage_s=5) as client:
            assert client.set("k", "v") and client.get("k") == b"v"
        bare = group.url.partition("?")[0]  # no password for the Sentinels: refused, saying so
        with redisconn.connect(bare, outage_s=0.5) as client, pytest.raises(redis.RedisError, match="(?i)auth"):
            client.get("k")


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A CA and a certificate for 127.0.0.1 that it signed (trustme), as PEM files."""
    import trustme

    from pdq.ops.redis_sentinel import TLSFiles
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    d = tmp_path_factory.mktemp("tls")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    cert.cert_chain_pems[0].write_to_path(str(d / "cert.pem"))
    cert.private_key_pem.write_to_path(str(d / "key.pem"))
    return TLSFiles(str(d / "ca.pem"), str(d / "cert.pem"), str(d / "key.pem"))


async def test_a_rediss_sentinel_url_speaks_tls_to_the_sentinels_and_the_primary_through_a_failover(tls_files):
    """Sentinels that listen on TLS alone, watching nodes' TLS ports: a rediss+sentinel:// URL
    with the CA reaches the primary, before and after a failover, from both kinds of client; the
    same URL without TLS finds no primary, and one without the CA is refused its certificate."""
    with SentinelGroup(replicas=1, sentinels=1, quorum=1, tls=tls_files) as group:
        assert group.url.startswith("rediss+sentinel://") and "ssl_ca_certs=" in group.url
        sync = redisconn.connect(group.url, outage_s=20)
        aio = redisconn.connect_async(group.url, outage_s=20)
        try:
            assert sync.set("before", "1") and await aio.get("before") == b"1"
            assert sync.connection_pool.get_connection().port == group.tls_ports[group.nodes[0].port]
            old = group.kill_primary()
            assert await aio.set("during", "2")  # waits for the replica the Sentinel promotes
            new = group.wait_for_failover(old.port)
            assert sync.get("during") == b"2" and group.replication(new)["role"] == "master"
        finally:
            sync.close()
            await aio.aclose()
        plain = group.url.replace("rediss+sentinel://", "redis+sentinel://", 1).partition("?")[0]
        with redisconn.connect(plain, outage_s=0.5) as client, pytest.raises(redis.ConnectionError):
            client.get("before")
        unverified = group.url.partition("?")[0]  # TLS, but not trusting the servers' CA
        with redisconn.connect(unverified, outage_s=0.5) as client, pytest.raises(redis.ConnectionError):
            client.get("before")


def test_a_rediss_sentinel_url_reads_its_tls_options_for_the_sentinels_too():
    url = parse_sentinel_url("rediss+sentinel://:pw@a:1/pdq/2?ssl_ca_certs=/etc/pdq/ca.pem&sentinel_password=s")
    assert url.tls and url.options["ssl_ca_certs"] == "/etc/pdq/ca.pem" and "connection_class" not in url.options
    assert url.sentinel_options == {"password": "s", "ssl": True, "ssl_ca_certs": "/etc/pdq/ca.pem"}
    assert not parse_sentinel_url("redis+sentinel://a:1/pdq").sentinel_options
    assert StoreConfig(redis_url="rediss+sentinel://a:1/pdq").redis_url == "rediss+sentinel://a:1/pdq"
