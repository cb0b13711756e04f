"""What the router and the engine server share at their gRPC edges: the conversions of
the messages both wires carry (``common``) and the plumbing of a kvhandoff gRPC server
(``grpc_server``: TLS, health and reflection, limits, shutdown on a signal, the event
loop's lag). It imports the light core only: never an engine, the connector or vLLM."""
