"""Worked examples built on gadgetloader (not part of the installed package)."""

from __future__ import annotations

__all__: list[str] = []
