"""The public API side: GenerateService (request planning, the servicer, responses), its
gRPC server with health and reflection, metrics, tracing and per-call stats."""
