"""Pure chunk planning for one prefill forward pass."""


def plan_chunks(remaining: list[int], max_batched_tokens: int, prefill_chunk: int) -> list[int]:
    """How many prompt tokens of each pending sequence (in order) go into the next pass.

    Each sequence gets at most `prefill_chunk` tokens and the pass at most `max_batched_tokens`,
    so a long prompt holds shorter ones back by one chunk at most. Returns one count per
    sequence (0 = not this pass); the first sequence always gets at least one token.
    """
    plan, budget = [], max_batched_tokens
    for need in remaining:
        take = min(need, prefill_chunk, budget)
        plan.append(take)
        budget -= take
    if plan and plan[0] == 0:
        plan[0] = min(remaining[0], prefill_chunk)
    return plan
