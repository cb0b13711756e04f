"""Generated gRPC stubs for the kvhandoff.v1 protocol (see proto/; scripts/gen-proto)."""
