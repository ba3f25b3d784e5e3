"""pdq prefill worker: batched, chunked prefill, the first token, and the KV hand-off."""
