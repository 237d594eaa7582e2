"""The SpeedTorch switcher protocol for one training step, as the README writes it (shared by
the tests that train through it)."""

from __future__ import annotations

from typing import Any


def speedtorch_step(
    model: Any, optimizer: Any, u: Any, uo: Any, v: Any, vo: Any, center: Any, ctx: Any, neg: Any
) -> Any:
    """One step of SpeedTorch's word2vec loop: the model switchers ``u`` / ``v`` and their
    optimizer switchers ``uo`` / ``vo`` around forward, backward and ``optimizer.step()``.
    Returns the loss."""
    lcenter = u.beforeForwardPass(center)
    uo.beforeForwardPass(center)
    lpos, lneg = v.beforeForwardPass(ctx, neg)
    vo.beforeForwardPass(ctx, neg)
    loss = model(lcenter, lpos, lneg)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    u.afterOptimizerStep(center)
    uo.afterOptimizerStep(center)
    v.afterOptimizerStep(ctx, neg)
    vo.afterOptimizerStep(ctx, neg)
    return loss
