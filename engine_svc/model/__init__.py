"""The model side: weights, the KV cache tensors, attention, the sampler and native kernels.

It reads requests only through ``engine_svc.types.RequestView`` and never imports the
scheduler side.
"""
