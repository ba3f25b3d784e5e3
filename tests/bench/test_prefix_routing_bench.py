"""The prefix-routing bench's workload and summary (no cluster: `pdq.bench.prefix_routing`)."""

from pdq.bench.prefix_routing import grouped, summarize

VOCAB = list(range(3, 500))


def test_every_request_opens_with_one_of_the_groups_system_prompts_and_the_same_seed_gives_the_same():
    w = grouped(VOCAB, 40, 3, seed=0, max_model_len=1280)
    systems = {r.prompt_token_ids[:1000] for r in w.requests}
    assert len(systems) == 3 and all(1016 <= r.prompt_len <= 1096 for r in w.requests)
    assert all(r.prompt_len + r.max_tokens <= 1280 for r in w.requests)
    assert grouped(VOCAB, 40, 3, seed=0, max_model_len=1280) == w
    assert grouped(VOCAB, 40, 3, seed=1, max_model_len=1280) != w


def test_the_summary_is_each_systems_median_over_its_repeats():
    def run(name, p50, hit, queried=100):
        return {"name": name, "ttft_ms": {"p50": p50}, "prefix_cache": {"hit_tokens": hit, "queried_tokens": queried}}
    got = summarize([run("load-only", 900, 60), run("prefix-routed", 100, 85), run("load-only", 30_000, 64),
                     run("prefix-routed", 120, 81), run("load-only", 700, 58), run("prefix-routed", 90, 83)])
    assert (got["load-only"]["ttft_p50_ms"], got["load-only"]["hit_rate"]) == (900, 0.6)
    assert (got["prefix-routed"]["ttft_p50_ms"], got["prefix-routed"]["hit_rate"], got["prefix-routed"]["repeats"]) == (100, 0.83, 3)


def test_the_summary_reports_the_hand_off_megabytes_of_separate_decode_workers():
    def run(name, sent):
        return {"name": name, "ttft_ms": {"p50": 100}, "prefix_cache": {"hit_tokens": 1, "queried_tokens": 2,
                                                                       "handoff_bytes": sent}}
    got = summarize([run("load-only", 90e6), run("prefix-routed", 20e6), run("load-only", 70e6)])
    assert (got["load-only"]["handoff_mb"], got["prefix-routed"]["handoff_mb"]) == (80.0, 20.0)
    assert summarize([{"name": "x", "ttft_ms": {"p50": 1}}])["x"]["handoff_mb"] == 0  # colocated: none
