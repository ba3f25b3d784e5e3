"""Generated protobuf and gRPC stubs of `protos/pdq/v1` (run `python -m pdq.protogen`)."""
