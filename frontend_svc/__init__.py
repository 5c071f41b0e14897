"""Tandem frontend service: the public API, tokenization, stop strings and engine routing."""
