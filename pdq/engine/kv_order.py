"""Which K/V a batched decode attention reads, and when sorting the pool's slots pays.

Decode attention runs over consecutive slot groups of the pool, each reading keys up to the
longest context in its group (a padded read: group size x that length). With slots in random
order every group reads about as far as the batch's longest sequence; with slots sorted by
length, longest first, each group reads little more than its own. Pure functions of the
sequences' K/V lengths in slot order.
"""

GROUP = 8  # slots per decode attention call
MIN_SAVING = 0.15  # group the attention only when it reads at least this share fewer keys
HORIZON_STEPS = 16  # a sort pays when this many steps' saved reads exceed the tokens it copies


def groups(lengths: list[int], group: int = GROUP) -> list[tuple[int, int, int]]:
    """[(first slot, end slot, longest length)] of consecutive groups of `group` slots."""
    return [(i, min(i + group, len(lengths)), max(lengths[i:i + group])) for i in range(0, len(lengths), group)]


def padded_reads(lengths: list[int], group: int = GROUP) -> int:
    """Key positions read by grouped decode attention over slots with these lengths."""
    return sum((end - start) * longest for start, end, longest in groups(lengths, group))


def worth_grouping(lengths: list[int], group: int = GROUP) -> bool:
    """Whether per-group calls read at least MIN_SAVING fewer keys than one call over all."""
    if len(lengths) <= group:
        return False
    return padded_reads(lengths, group) <= (1 - MIN_SAVING) * len(lengths) * max(lengths)


def sort_order(lengths: list[int], group: int = GROUP, horizon: int = HORIZON_STEPS) -> list[int] | None:
    """The slot order (longest first) to move the pool to, or None when it would not pay: the
    keys it saves over `horizon` steps must exceed twice the positions it copies (each moved
    sequence's K/V is copied out and back)."""
    if len(lengths) <= group:
        return None
    order = sorted(range(len(lengths)), key=lambda s: -lengths[s])
    moved = sum(lengths[src] for dst, src in enumerate(order) if dst != src)
    if not moved:
        return None
    saved = padded_reads(lengths, group) - padded_reads([lengths[s] for s in order], group)
    return order if saved * horizon > 2 * moved else None
