"""Small pieces both services share (logging set-up); no torch, no protobuf."""
