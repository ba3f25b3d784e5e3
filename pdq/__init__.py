"""pdq: an open LLM batching service (gRPC gateway, Redis-backed scheduler, P/D workers)."""

__version__ = "0.1.0"
