"""Pure chunk planning for one prefill forward pass."""

from collections.abc import Callable


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


def waits_for_shared_prefix(prompt: list[int], cached: Callable[[], int], computing: list[list[int]],
                            block_size: int) -> bool:
    """Whether a prompt not yet admitted should wait for a pass: one of the prompts this pass
    computes (`computing`) will, once its blocks are written and named, hold more of this
    prompt's leading full blocks than the prefix cache holds now (`cached()` tokens, asked only
    when a computing prompt shares its first block). Waiting one pass then skips their prefill
    (n choices of one prompt, a burst sharing a system prompt) instead of computing the same
    blocks twice in one pass. Only blocks the cache could give it count: full ones, before its
    last token."""
    usable = (len(prompt) - 1) // block_size * block_size
    first = prompt[:block_size]
    computing = [other for other in computing if usable and other[:block_size] == first]
    if not computing:
        return False
    held = cached()
    start = held - held % block_size
    for other in computing:
        at = start
        while at + block_size <= min(usable, len(other)) and prompt[at:at + block_size] == other[at:at + block_size]:
            at += block_size
        if at > start and prompt[:start] == other[:start]:
            return True
    return False
