"""The service side: the gRPC servicer and server, the engine loop's thread, metrics and tracing."""
