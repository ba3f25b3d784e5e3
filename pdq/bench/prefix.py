"""Prefix-cache hits during a run: how many prompt tokens a system looked up in its prefix cache,
and how many it found there (their prefill skipped); with separate prefill and decode workers,
also the K/V bytes the hand-offs carried and the prompt positions they left out (the decode
worker's cache held them). For a spawned cluster, read from its workers' /metrics
(`pdq_prefix_cache_{queried,hit}_tokens_total`, stage "prefill"; `pdq_kv_transfer_bytes_total`,
outcome "ok"; `pdq_kv_transfer_skipped_tokens_total`) before and after the run; for the
in-process engine, from its block manager's counters."""

import re
import urllib.request

_LINE = re.compile(r'^pdq_prefix_cache_(queried|hit)_tokens_total\{stage="prefill"\} ([0-9.e+]+)$', re.M)
_SENT = re.compile(r'^pdq_kv_transfer_bytes_total\{outcome="ok",transport="(?:grpc|tcp)"\} ([0-9.e+]+)$', re.M)
_SKIPPED = re.compile(r'^pdq_kv_transfer_skipped_tokens_total ([0-9.e+]+)$', re.M)


def scrape(url: str, timeout_s: float = 5.0) -> tuple[int, int, int, int]:
    """(queried, hit) prompt tokens, (K/V bytes handed off, positions left out) so far at one
    /metrics endpoint; 0 for what it has none of."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        text = resp.read().decode()
    got = {kind: int(float(value)) for kind, value in _LINE.findall(text)}
    return (got.get("queried", 0), got.get("hit", 0), int(sum(float(v) for v in _SENT.findall(text))),
            int(sum(float(v) for v in _SKIPPED.findall(text))))


def counts(queried: int, hit: int, sent_bytes: int = 0, skipped: int = 0) -> dict:
    return {"queried_tokens": queried, "hit_tokens": hit, "handoff_bytes": sent_bytes, "handoff_skipped_tokens": skipped}


class PrefixProbe:
    """The prefix-cache counters of some /metrics endpoints, summed, over a run."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self._start = (0, 0, 0, 0)

    def _read(self) -> tuple[int, int, int, int]:
        total = [0, 0, 0, 0]
        for url in self.urls:
            total = [a + b for a, b in zip(total, scrape(url))]
        return total[0], total[1], total[2], total[3]

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> dict:
        now = self._read()
        return counts(*(a - b for a, b in zip(now, self._start)))


def cluster_prefix_probe(cluster) -> PrefixProbe | None:
    """A probe over the workers of a `pdq.ops.up.Cluster` (None when it serves no /metrics)."""
    urls = [c.metrics_url(cluster.host) for c in cluster.children
            if c.name.startswith(("prefill", "decode")) and c.metrics_port >= 0]
    return PrefixProbe(urls) if urls else None
