"""kvhandoff's light core: request types and errors, the block budget, the built-in model
(corpus, training, generator), TLS, ports and the generated protobuf stubs (``v1``).
Imports no engine, no cluster manager and no gRPC server: every layer builds on it."""

__all__: list[str] = []
