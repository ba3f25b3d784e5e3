"""Observability: OpenTelemetry traces (and their gRPC interceptors), Prometheus metrics, loop liveness."""
