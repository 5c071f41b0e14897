"""Where the decoder's arithmetic runs: layer implementations installed over the plain
torch decoder of ``arch/`` once, at load.

    backend.py              install_backend: the choice (``--kernels``, dtype, CPU) and its order
    native_layers.py        linears, norms and RoPE on the native CPU kernels
    packed_linear.py        bf16 weights packed once for the native GEMM
    quantized_layers.py     linears over integer weights (int8 / int4 layouts)
    quantized_embeddings.py the embedding and the LM head over quantized weights
    decode_stack.py         a decode-only step's decoder layers in one native call
    threads.py              how many threads each step runs on

A new layer backend is a module here that replaces layers of ``arch/``'s ``Transformer``
and a line in ``backend.py``; it imports nothing of ``load/`` or ``sample/``.
"""
