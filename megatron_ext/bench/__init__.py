"""Benchmarks: every figure is compared with a peer or a physical limit measured in the same run."""
