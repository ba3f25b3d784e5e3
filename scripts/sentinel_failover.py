"""Measures what a Sentinel failover costs a pdq Redis client: time to resume and writes lost.

Starts a primary, one replica and three Sentinels (pdq.ops.redis_sentinel, quorum 2, down after
500 ms), runs WRITERS concurrent writers through a pdq.state.redisconn client of the redis+sentinel://
URL (each SET acknowledged is noted with its time), SIGKILLs the primary, and reports:
- resume: from the kill to the first acknowledgement of a write sent after it;
- lost: acknowledged writes the new primary does not have, and how long before the kill the
  earliest of them was acknowledged (the loss window);
- with --wait N, a write counts as acknowledged only after `WAIT N 1000` on its connection
  confirmed N replicas have it.

    .venv/bin/python scripts/sentinel_failover.py --runs 5 [--wait 1 --replicas 2]
"""

import argparse
import asyncio
import time

from pdq.state import redisconn
from pdq.ops.redis_sentinel import SentinelGroup

WRITERS = 8


async def one_run(wait: int, replicas: int) -> dict:
    with SentinelGroup(replicas=replicas, failover_timeout_ms=1000) as group:
        client = redisconn.connect_async(group.url, outage_s=30)
        acked: dict[str, float] = {}  # key -> when its write was acknowledged
        sent: dict[str, float] = {}  # key -> when its write was sent
        stop = asyncio.Event()

        async def writer(w: int) -> None:
            i = 0
            while not stop.is_set():
                key = f"w{w}:{i}"
                sent[key] = time.monotonic()
                if wait:
                    async with client.pipeline(transaction=False) as pipe:  # one connection: WAIT covers the SET
                        _, replicas = await pipe.set(key, "1").wait(wait, 1000).execute()
                    if replicas < wait:
                        continue  # not acknowledged
                else:
                    await client.set(key, "1")
                acked[key] = time.monotonic()
                i += 1

        tasks = [asyncio.create_task(writer(w)) for w in range(WRITERS)]
        await asyncio.sleep(1.0)
        old = await asyncio.to_thread(group.kill_primary)  # the writers' replies are read meanwhile
        killed = time.monotonic()
        while not (after := [t for k, t in acked.items() if sent[k] > killed]):
            if time.monotonic() - killed > 20:
                raise SystemExit("no write acknowledged within 20 s of the kill (--wait N needs N replicas left)")
            await asyncio.sleep(0.005)
        resume_s = min(after) - killed
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*tasks)
        group.wait_for_failover(old.port)
        keys = list(acked)
        async with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.exists(key)
            present = await pipe.execute()
        lost = [k for k, there in zip(keys, present) if not there]
        await client.aclose()
        before = [killed - acked[k] for k in lost]
        return dict(acked=len(acked), before_kill=sum(t <= killed for t in acked.values()), resume_s=resume_s,
                    lost=len(lost), window_ms=max(before) * 1000 if before else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--wait", type=int, default=0, help="WAIT for this many replicas after each write")
    parser.add_argument("--replicas", type=int, default=1, help="replicas of the primary (with --wait N: N + 1, "
                                                                "so that N are left after the failover)")
    args = parser.parse_args()
    for run in range(args.runs):
        r = asyncio.run(one_run(args.wait, args.replicas))
        print(f"run {run + 1}: {r['acked']} writes acknowledged ({r['before_kill']} before the kill); serving resumed "
              f"{r['resume_s']:.2f} s after the kill; lost {r['lost']} (window {r['window_ms']:.2f} ms)", flush=True)


if __name__ == "__main__":
    main()
