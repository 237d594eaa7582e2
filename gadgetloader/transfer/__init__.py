"""How rows move between a table and the GPU: strategies, kernels, the engine."""

from __future__ import annotations

from ._engine import STRATEGIES, gather, resolve_strategy, scatter

__all__ = ["STRATEGIES", "gather", "resolve_strategy", "scatter"]
