"""Benchmarks that ship with the library (``gadgetloader bench``)."""

from __future__ import annotations

__all__: list[str] = []
