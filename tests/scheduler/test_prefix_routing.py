"""Prefix-aware placement: the pure policy (unit tests and hypothesis properties), the engine's
report of its cached prefixes, and a real scheduler placing by what fake workers report."""

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from pdq.engine.blocks import BlockManager, block_hashes
from pdq.state.registry import PREFIX_HEX, WorkerInfo, heartbeat, live_workers
from pdq.state.store import AsyncStore
from scheduler.policies import (Candidate, PrefixRouting, SentPrefixes, chain_hashes, handoff_skip, matched_tokens,
                                place_prefill)
from tests.scheduler.fakes import wait_for
from tests.scheduler.harness import ended, harness, spec

SYSTEM = list(range(100, 164))  # a 64-token system prompt: 4 blocks of 16


def cand(rid, avoid=()):
    return Candidate(rid, 80, 8, avoid=frozenset(avoid))


# -- hashing and matching ----------------------------------------------------------------------

def test_the_scheduler_hashes_a_prompt_as_the_engine_names_its_blocks():
    tokens = list(range(7, 7 + 70))
    assert chain_hashes(tokens, 16, PREFIX_HEX) == [h.hex()[:PREFIX_HEX] for h in block_hashes(tokens[:64], 16)]
    # a 64-token prompt offers 3 blocks: its last token is always computed
    assert chain_hashes(tokens[:64], 16, PREFIX_HEX) == chain_hashes(tokens, 16, PREFIX_HEX)[:3]


def test_a_prompt_matches_up_to_the_deepest_block_a_worker_holds_even_past_a_missing_one():
    hashes = chain_hashes(SYSTEM + [1, 2, 3], 16, PREFIX_HEX)
    assert matched_tokens(hashes, 16, set()) == 0
    assert matched_tokens(hashes, 16, {hashes[0], hashes[1]}) == 32
    assert matched_tokens(hashes, 16, {hashes[3]}) == 64  # a chain hash names its whole prefix
    other = chain_hashes([9] + SYSTEM[1:] + [1], 16, PREFIX_HEX)
    assert matched_tokens(other, 16, set(hashes)) == 0  # one token off in the first block: nothing shared


def test_a_hand_off_may_skip_the_leading_blocks_a_decode_worker_reports_and_no_more():
    prompt = list(range(3, 3 + 70))  # 4 full blocks of 16 a cache could serve (the last token is computed)
    hashes = chain_hashes(prompt, 16, PREFIX_HEX)
    assert handoff_skip(prompt, 16, set(hashes[:3]), PREFIX_HEX) == 48
    assert handoff_skip(prompt, 16, set(chain_hashes([9] * 70, 16, PREFIX_HEX)), PREFIX_HEX) == 0  # another prompt's
    assert handoff_skip(prompt, 16, (), PREFIX_HEX) == 0 and handoff_skip(prompt, 0, set(hashes), PREFIX_HEX) == 0


def test_the_engine_reports_the_prefixes_it_holds_in_use_first_then_most_recently_used():
    blocks = BlockManager(num_blocks=16, block_size=4)
    a, b = list(range(1, 10)), list(range(50, 59))
    for seq, tokens in (("a", a), ("b", b)):
        blocks.allocate(seq, tokens)
        blocks.commit(seq, tokens)
    blocks.free("a")
    got = [h.hex()[:PREFIX_HEX] for h in blocks.cached_hashes(16)]
    assert got[:2] == chain_hashes(b, 4, PREFIX_HEX)  # held by b
    assert set(got[2:]) == set(chain_hashes(a, 4, PREFIX_HEX))  # cached, free
    assert len(blocks.cached_hashes(3)) == 3
    assert BlockManager(4, 4, prefix_cache=True).cached_hashes(8) == []


# -- the choice --------------------------------------------------------------------------------

def test_a_batch_goes_where_its_prefix_is_cached_though_that_worker_is_busier():
    batch = [cand("r1"), cand("r2")]
    matched = {"r1": {"w1": 64}, "r2": {"w1": 64}}
    assert PrefixRouting().place(batch, [("w0", 0), ("w1", 30)], 1000, matched) == ("w1", batch)


def test_load_outweighs_a_cached_prefix_worth_less_than_the_work_queued_there():
    batch = [cand("r1")]
    assert PrefixRouting(weight=1.0).place(batch, [("w0", 0), ("w1", 100)], 1000, {"r1": {"w1": 64}}) == ("w0", batch)
    assert PrefixRouting(weight=2.0).place(batch, [("w0", 0), ("w1", 100)], 1000, {"r1": {"w1": 64}}) == ("w1", batch)


def test_requests_cached_elsewhere_wait_a_round_for_their_own_worker():
    batch = [cand("r1"), cand("r2"), cand("r3")]
    matched = {"r1": {"w0": 64}, "r2": {"w1": 64}, "r3": {}}
    target, going = PrefixRouting().place(batch, [("w0", 0), ("w1", 0)], 1000, matched)
    assert (target, [c.request_id for c in going]) == ("w0", ["r1", "r3"])


def test_a_new_prefix_goes_to_the_worker_with_fewer_sequences_running():
    batch = [cand("r1")]
    assert PrefixRouting().place(batch, [("w0", 0), ("w1", 0)], 1000, {}, busy={"w0": 3, "w1": 1})[0] == "w1"
    assert PrefixRouting().place(batch, [("w0", 0), ("w1", 0)], 1000, {"r1": {"w0": 64}}, busy={"w0": 3})[0] == "w0"


def test_a_worker_at_its_cap_or_avoided_takes_nothing_though_it_holds_the_prefix():
    matched = {"r1": {"w1": 64}}
    assert PrefixRouting().place([cand("r1")], [("w0", 0), ("w1", 500)], 500, matched)[0] == "w0"
    assert PrefixRouting().place([cand("r1", avoid={"w1"})], [("w0", 0), ("w1", 0)], 500, matched)[0] == "w0"


loads_st = st.lists(st.integers(0, 3000), min_size=1, max_size=4).map(
    lambda ns: [(f"w{i}", n) for i, n in enumerate(ns)])
batch_st = st.lists(st.sets(st.sampled_from(["w0", "w1", "w2", "w3"]), max_size=2), min_size=1, max_size=5).map(
    lambda avoids: [cand(f"r{i}", a) for i, a in enumerate(avoids)])


@given(batch_st, loads_st)
def test_with_nothing_cached_it_places_as_load_only_placement(batch, loads):
    assert PrefixRouting().place(batch, loads, 2000, {}) == place_prefill(batch, loads, 2000)


@given(batch_st, loads_st, st.data())
def test_the_first_request_that_can_go_goes_to_its_best_scoring_open_worker(batch, loads, data):
    matched = {c.request_id: {w: data.draw(st.sampled_from([0, 16, 64, 1024])) for w, _ in loads} for c in batch}
    target, going = PrefixRouting().place(batch, loads, 2000, matched)
    expected, _ = place_prefill(batch, loads, 2000)
    assert (target is None) == (expected is None)
    if target is None:
        return
    assert going and all(c in batch for c in going)
    first = going[0]
    load = dict(loads)
    usable = [w for w, _ in loads]
    score = lambda w: 4.0 * matched[first.request_id][w] - load[w]  # noqa: E731
    open_ = [w for w, n in loads if n < 2000 and (w not in first.avoid or all(u in first.avoid for u in usable))]
    assert load[target] < 2000 and score(target) == max(score(w) for w in open_)


def test_what_was_sent_to_a_worker_counts_until_it_expires_or_the_worker_is_gone():
    sent = SentPrefixes(ttl_ms=1000, per_worker=3)
    sent.add("w0", ["a", "b"], now_ms=0)
    sent.add("w0", ["c", "d"], now_ms=500)
    assert sent.held("w0", 600) == {"b", "c", "d"}  # bounded: the least recently sent went
    assert sent.held("w0", 1200) == {"c", "d"}
    sent.forget(["w1"])
    assert sent.held("w0", 1200) == set()


# -- the registry and a real scheduler ---------------------------------------------------------

async def test_a_heartbeat_carries_the_prefixes_to_the_scheduler(redis_server, prefix):
    from pdq.state import redisconn
    client = redisconn.connect_async(redis_server.url)
    store = AsyncStore(client, prefix)
    try:
        await heartbeat(store, WorkerInfo("p0", "prefill", "h:1", kv_block_size=16, prefixes=("ab", "cd")), ttl_s=5)
        (got,) = (await live_workers(store, ("prefill",), 5.0))["prefill"]
        assert (got.kv_block_size, got.prefixes) == (16, ("ab", "cd"))
    finally:
        await client.aclose()


def _report(worker, prompts):
    """Makes a fake prefill worker report the prefixes of `prompts` (block size 16)."""
    held = tuple(h for p in prompts for h in chain_hashes(p, 16, PREFIX_HEX))
    worker.info = lambda: WorkerInfo(worker.worker_id, "prefill", worker.address, kv_block_size=16, prefixes=held)


async def _placed_on(routing: bool, redis_url: str, prefix: str) -> list[list[str]]:
    """Two fake prefill workers, the second reporting SYSTEM; three requests opening with SYSTEM,
    one after another. -> the batches each worker got."""
    async with harness(redis_url, prefix, workers=dict(decode=2, prefill=2), prefix_routing=routing) as h:
        p0, p1 = h.workers.prefillers
        _report(p0, [])
        _report(p1, [SYSTEM + [1]])
        await _three_in_turn(h, "prefill")
        return [p0.batches, p1.batches]


async def _three_in_turn(h, role: str) -> None:
    """Once both workers of `role` report block size 16: three requests opening with SYSTEM,
    each submitted once the one before it ended."""
    await wait_for(lambda: _all_report(h, role))
    for i in range(3):
        s = spec(f"r{i}")
        s.prompt_token_ids[:] = SYSTEM + [i + 1] * 8
        await h.submit(s)
        await ended(h, [f"r{i}"])


async def test_the_scheduler_sends_a_prompt_to_the_worker_holding_its_prefix(redis_server, prefix):
    assert await _placed_on(True, redis_server.url, prefix) == [[], [["r0"], ["r1"], ["r2"]]]


async def test_without_prefix_routing_the_least_loaded_worker_takes_it(redis_server, prefix):
    assert await _placed_on(False, redis_server.url, prefix) == [[["r0"], ["r1"], ["r2"]], []]


async def test_requests_sharing_a_new_prefix_follow_the_first_before_any_worker_reports_it(redis_server, prefix):
    # (the default weight: SYSTEM cached there outweighs the first request's prompt in flight there)
    async with harness(redis_server.url, prefix, workers=dict(decode=2, prefill=2)) as h:
        p0, p1 = h.workers.prefillers
        for w in (p0, p1):
            _report(w, [])
        p0.prefill_s = p1.prefill_s = 0.3  # the first batch is still in flight when the rest arrive
        await wait_for(lambda: _all_report(h))
        first = spec("a0")
        first.prompt_token_ids[:] = SYSTEM + [1] * 8
        await h.submit(first)
        await wait_for(lambda: _dispatched(h, "a0"))
        rest = []
        for i in range(1, 3):
            s = spec(f"a{i}")
            s.prompt_token_ids[:] = SYSTEM + [i + 1] * 8
            await h.submit(s)
            rest.append(s.request_id)
        await ended(h, ["a0", *rest])
        holder = p0 if p0.batches and p0.batches[0] == ["a0"] else p1
        assert sorted(r for b in holder.batches for r in b) == ["a0", "a1", "a2"]


async def _all_report(h, role: str = "prefill") -> bool:
    workers = (await live_workers(h.store, (role,), 5.0))[role]
    return len(workers) == 2 and all(w.kv_block_size == 16 for w in workers)


async def _dispatched(h, rid) -> bool:
    return await h.state(rid) not in ("", "QUEUED")



# -- the decode worker of a separate P/D cluster ------------------------------------------------

def test_a_separate_decode_worker_holding_the_prefix_takes_it_while_its_free_slots_weigh_less():
    from scheduler.policies import HOME_BONUS, DecodePrefix, DecodeSlots, choose_decode_worker, home_worker
    holder, empty = DecodeSlots("d0", "h:0", 3), DecodeSlots("d1", "h:1", 9)
    key = next(k for k in map(str, range(100)) if home_worker(k, [holder, empty]) is empty)  # d1 is its home
    held = DecodePrefix(key, {"d0": 64})
    # 64 of 80 prompt tokens cached on d0 (0.8 + 3/9 = 1.13) lose to d1's room at home (0 + 9/9 + 0.5)
    assert choose_decode_worker([holder, empty], prefix=held, prompt_tokens=80).worker_id == "d1"
    holder.free_slots = 8  # 0.8 + 8/9 = 1.69 beats 1.5
    assert choose_decode_worker([holder, empty], prefix=held, prompt_tokens=80).worker_id == "d0"
    holder.free_slots = 0  # full: never, whatever it holds
    assert choose_decode_worker([holder, empty], prefix=DecodePrefix(key, {"d0": 80}),
                                prompt_tokens=80).worker_id == "d1"
    assert HOME_BONUS == 0.5
    # the prefill worker's own decode side still comes first (no transfer at all), and an avoided one last
    both = [DecodeSlots("d0", "h:0", 9), DecodeSlots("d1", "h:1", 1)]
    assert choose_decode_worker(both, local="h:1", prefix=DecodePrefix(key, {"d0": 80}),
                                prompt_tokens=80).worker_id == "d1"
    assert choose_decode_worker(both, avoid={"d0"}, prefix=DecodePrefix(key, {"d0": 80}),
                                prompt_tokens=80).worker_id == "d1"


def test_a_prefix_no_worker_holds_or_all_hold_goes_to_its_home_unless_another_has_far_more_room():
    from scheduler.policies import DecodePrefix, DecodeSlots, choose_decode_worker, home_worker
    workers = [DecodeSlots(f"d{i}", f"h:{i}", 6) for i in range(3)]
    homes = {k: home_worker(k, workers).worker_id for k in map(str, range(60))}
    assert set(homes.values()) == {"d0", "d1", "d2"}  # prefixes spread over the workers
    for key, home in homes.items():
        for cached in ({}, {"d0": 64, "d1": 64, "d2": 64}):
            assert choose_decode_worker(workers, prefix=DecodePrefix(key, cached), prompt_tokens=80).worker_id == home
    key = next(k for k, h in homes.items() if h == "d0")
    workers[0].free_slots = 2  # 2/6 + 0.5 < 6/6: the home has far less room than the others
    assert choose_decode_worker(workers, prefix=DecodePrefix(key), prompt_tokens=80).worker_id != "d0"
    workers[0].free_slots = 4  # 4/6 + 0.5 > 1: still home
    assert choose_decode_worker(workers, prefix=DecodePrefix(key), prompt_tokens=80).worker_id == "d0"
    # a worker leaving moves only its own prefixes
    rest = [w for w in workers if w.worker_id != "d2"]
    assert all(home_worker(k, rest).worker_id == h for k, h in homes.items() if h != "d2")


@given(st.lists(st.integers(0, 8), min_size=1, max_size=4))
def test_without_a_prefix_the_decode_choice_is_the_most_free_slots(free):
    from scheduler.policies import DecodePrefix, DecodeSlots, choose_decode_worker
    slots = [DecodeSlots(f"d{i}", f"h:{i}", n) for i, n in enumerate(free)]
    plain = choose_decode_worker(slots)
    assert choose_decode_worker(slots, prefix=None, prompt_tokens=80) == plain
    assert choose_decode_worker(slots, prefix=DecodePrefix(""), prompt_tokens=80) == plain  # shorter than a block


async def _decoded_on(routing: bool, redis_url: str, prefix: str, other_slots: int = 4
                      ) -> tuple[dict[str, list[str]], list[int]]:
    """One fake prefill worker, two separate decode workers (4 slots, and `other_slots`), the
    first reporting SYSTEM in its prefix cache (block size 16); three requests opening with
    SYSTEM, one after another. -> (decode worker id -> the requests it decoded, each item's
    decode_cached_tokens)."""
    async with harness(redis_url, prefix, workers=dict(decode=2, prefill=1), prefix_routing=routing) as h:
        (p0,) = h.workers.prefillers
        d0, d1 = h.workers.decoders.values()
        d1.slots = other_slots
        held = tuple(chain_hashes(SYSTEM + [1], 16, PREFIX_HEX))
        for d, prefixes in ((d0, held), (d1, ())):
            base = d.info
            d.info = lambda base=base, prefixes=prefixes: replace(base(), kv_block_size=16, prefixes=prefixes)
        joined: dict[str, list[str]] = {d0.worker_id: [], d1.worker_id: []}
        skips: list[int] = []
        for d in (d0, d1):
            join = d.join

            async def recording(item, d=d, join=join):
                joined[d.worker_id].append(item.spec.request_id)
                skips.append(item.decode_cached_tokens)
                return await join(item)
            d.join = recording
        await _three_in_turn(h, "decode")
        return joined, skips


async def test_a_separate_decode_worker_holding_the_prefix_takes_the_request_and_its_hand_off_skips_it(
        redis_server, prefix):
    # equal slots: d0 scores at least 64/72 + 3/4 (a heartbeat may still show its last request's
    # slot taken), d1 at most 4/4 + 0.5 (if it is the prefix's home)
    joined, skips = await _decoded_on(True, redis_server.url, prefix)
    assert joined == {"decode-0": ["r0", "r1", "r2"], "decode-1": []}
    assert skips == [64, 64, 64]  # SYSTEM's 4 blocks: the prefill worker sends the rest


async def test_without_prefix_routing_the_decode_worker_with_most_free_slots_takes_it(redis_server, prefix):
    joined, skips = await _decoded_on(False, redis_server.url, prefix, other_slots=8)
    assert joined == {"decode-0": [], "decode-1": ["r0", "r1", "r2"]}  # 7 or 8 free against 3 or 4
    assert skips == [0, 0, 0]
