"""pdq gateway: the public API (auth, validation, deadlines, streaming). Holds no queue state."""
