"""From a checkpoint on disk to a model ready to serve: the formats the engine reads.

    loader.py          safetensors (Hugging Face layout) into the decoder's weights
    gguf_metadata.py   a GGUF file's header, bounded, and the config it implies
    gguf_checkpoint.py ``--model PATH.gguf``: a GGUF file seen as a checkpoint directory
    gguf_weights.py    a GGUF file's tensors, dequantized, under Hugging Face names
    gguf_quantized.py  a GGUF file's quantized blocks, kept as they are
    hf_quantized.py    GPTQ / AWQ / compressed-tensors integers, kept as they are
    served.py          load_served_model: weights read, layers on the chosen backend

A new checkpoint format is a reader here that ends in the decoder's weights or in
``QuantizedWeight``s; it imports nothing of ``sample/``.
"""
