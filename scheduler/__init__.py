"""pdq scheduler: the Redis-backed queue and the dispatcher of prefill batches."""
