"""The text side: tokenizer, incremental detokenizer, stop strings, and the per-choice
output processor that chains them. Plain Python: it never imports grpc or protobuf."""
