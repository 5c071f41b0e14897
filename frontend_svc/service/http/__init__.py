"""The frontend's HTTP face: OpenAI-compatible and Anthropic Messages APIs over the same plan as gRPC."""
