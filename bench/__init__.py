"""Benchmarks: batching, KV caching, offline throughput; results land in bench/results/."""
