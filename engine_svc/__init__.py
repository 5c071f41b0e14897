"""Tandem engine service: scheduler, paged KV cache, model runner and sampler."""
