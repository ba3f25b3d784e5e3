"""Pure scheduling policies: plain data in, decisions out; no Redis, no gRPC.

Order of choice when forming a batch, each layer chosen by name in SchedulerConfig:
1. `tiers`: between priority tiers (`aging`, `strict`);
2. `fair`: between the tenants of a tier (`vtc`, `fifo`);
3. `order`: inside a tenant (`fcfs`, `sjf`, `edf`), as the score of its queue in Redis.
`plan.schedule` composes them; `batch.form_batch` cuts a batch from the order and
`batch.place_prefill` / `batch.choose_decode_worker` place it (keeping a failed request away from
the workers that failed it, and a prompt's KV with decode workers of its prefill worker's dtype); `headroom` keeps the decode pool's last free slots for tenants below
their fair share; `prefix` places a batch where its prompts' prefixes are cached, weighed against
load; `tiers.preemptible_tiers` says whom a request finding no room may preempt; `retry` tells a request's own failures from lost attempts and quarantines
workers whose hand-offs keep failing; `liveness` tells the janitor which workers are dead.
"""

from scheduler.policies.admission import DrainRate, kv_misfit, resolve_tier, retry_after_ms
from scheduler.policies.batch import (HOME_BONUS, Candidate, DecodePrefix, DecodeSlots, acceptable, choose_decode_worker,
                                      decode_chooser, form_batch, home_worker, kv_matched, place_prefill,
                                      same_kv_dtype)
from scheduler.policies.headroom import Headroom, Placement, below_share, place_round, prefill_priority
from scheduler.policies.fair import FAIR_POLICIES, FIFO, VTC, TenantQueue, fair_policy
from scheduler.policies.liveness import HeartbeatWatch
from scheduler.policies.order import ORDER_POLICIES
from scheduler.policies.plan import TierQueue, schedule
from scheduler.policies.prefix import PrefixRouting, SentPrefixes, chain_hashes, handoff_skip, matched_tokens
from scheduler.policies.retry import Quarantine, classify, prefer_healthy
from scheduler.policies.tiers import AgingTiers, StrictTiers, preemptible_tiers, tier_policy

__all__ = ["HOME_BONUS", "AgingTiers", "Candidate", "DecodePrefix", "DecodeSlots", "DrainRate", "FAIR_POLICIES", "FIFO", "Headroom", "HeartbeatWatch",
           "ORDER_POLICIES", "Placement", "PrefixRouting", "Quarantine", "SentPrefixes", "StrictTiers", "TenantQueue", "TierQueue", "VTC", "acceptable", "below_share",
           "chain_hashes", "choose_decode_worker", "classify", "decode_chooser", "fair_policy", "form_batch", "handoff_skip", "home_worker", "kv_matched", "matched_tokens", "place_prefill", "place_round", "prefer_healthy",
           "kv_misfit", "preemptible_tiers", "prefill_priority", "resolve_tier", "retry_after_ms", "same_kv_dtype", "schedule", "tier_policy"]
