"""GenerateStream and StreamResult messages read as the tokens they carry. A message holds one
token or several (a request's stream_interval, or every entry already there when the gateway
read the stream behind it: `gateway.results.coalesce`), so tests check tokens and their
indices, never how many messages carried them."""


def streamed(msgs) -> tuple[list[int], list[int]]:
    """(the index of every token, the tokens) over the messages that carry tokens, in order;
    each such message's `token_id` is its first token."""
    indices: list[int] = []
    tokens: list[int] = []
    for m in msgs:
        if m.HasField("index"):
            assert m.token_ids and m.token_id == m.token_ids[0], m
            indices += range(m.index, m.index + len(m.token_ids))
            tokens += m.token_ids
    return indices, tokens


def until_tokens(stream, n: int) -> list:
    """The next messages of `stream` until they carry at least `n` tokens (a message is never
    split, so there may be more)."""
    got: list = []
    while len(streamed(got)[1]) < n:
        got.append(next(stream))
    return got
