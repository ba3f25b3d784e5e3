"""Transport: gRPC serving, status errors, internal mutual TLS, the KV hand-off (gRPC and TCP), protobuf at the edges."""
