"""Assembles a pdserve deployment: configuration, worker pools, the `pdserve` command, metrics."""

__all__: list[str] = []
