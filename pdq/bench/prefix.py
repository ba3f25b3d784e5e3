"""Prefix-cache hits during a run: how many prompt tokens a system looked up in its prefix cache,
and how many it found there (their prefill skipped). For a spawned cluster, read from its
workers' /metrics (`pdq_prefix_cache_{queried,hit}_tokens_total`, stage "prefill") before and
after the run; for the in-process engine, from its block manager's counters."""

import re
import urllib.request

_LINE = re.compile(r'^pdq_prefix_cache_(queried|hit)_tokens_total\{stage="prefill"\} ([0-9.e+]+)$', re.M)


def scrape(url: str, timeout_s: float = 5.0) -> tuple[int, int]:
    """(queried, hit) prompt tokens so far at one /metrics endpoint; (0, 0) if it has none."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        text = resp.read().decode()
    got = {kind: int(float(value)) for kind, value in _LINE.findall(text)}
    return got.get("queried", 0), got.get("hit", 0)


def counts(queried: int, hit: int) -> dict:
    return {"queried_tokens": queried, "hit_tokens": hit}


class PrefixProbe:
    """The prefix-cache counters of some /metrics endpoints, summed, over a run."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self._start = (0, 0)

    def _read(self) -> tuple[int, int]:
        q = h = 0
        for url in self.urls:
            a, b = scrape(url)
            q, h = q + a, h + b
        return q, h

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> dict:
        q, h = self._read()
        return counts(q - self._start[0], h - self._start[1])


def cluster_prefix_probe(cluster) -> PrefixProbe | None:
    """A probe over the workers of a `pdq.ops.up.Cluster` (None when it serves no /metrics)."""
    urls = [c.metrics_url(cluster.host) for c in cluster.children
            if c.name.startswith(("prefill", "decode")) and c.metrics_port >= 0]
    return PrefixProbe(urls) if urls else None
