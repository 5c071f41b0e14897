"""Generated protobuf and gRPC code; regenerate with tools/gen_protos.py."""
