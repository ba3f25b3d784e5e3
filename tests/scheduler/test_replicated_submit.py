"""--submit-wait-replicas: a submit is answered only once Redis replicas have it (Redis WAIT on the
submit's own connection), so a failover cannot lose an acknowledged request; when they do not
confirm it in time the caller gets UNAVAILABLE, and a retry with the same id is safe."""

import grpc
import pytest

from pdq.ops.redis_sentinel import SentinelGroup
from tests.scheduler.harness import harness, spec

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture
def group():
    with SentinelGroup(replicas=1, sentinels=0) as g:  # a primary and one replica, in sync
        yield g


async def test_a_submit_waits_for_its_replica_and_says_so_when_the_replica_is_gone(group, prefix):
    primary, replica = group.nodes
    async with harness(primary.url, prefix, submit_wait_replicas=1, submit_wait_ms=300) as h:
        assert (await h.submit(spec("r1"))).created
        replica.stop()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.submit(spec("r2"))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "0 of the 1 replicas" in err.value.details() and "same request_id" in err.value.details()
        assert (await h.store.record("r2"))["state"] == "QUEUED"  # queued on the primary all the same
        replica.start()  # back, and in sync again: the retry with the same id is the same request
        got = None
        for _ in range(50):
            try:
                got = await h.submit(spec("r2"))
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE  # until the replica has synced
        assert got is not None and not got.created and got.request_id == "r2"
