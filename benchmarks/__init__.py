"""Tandem benchmarks: workloads, the offline engine benchmark and the serving load generator."""
