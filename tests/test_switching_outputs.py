"""What a drop-in lookup's output allows, on every placement with ids on the device:
in-place operations on it (as on ``nn.Embedding``'s output; the CUDA lookup's autograd
function once returned a view, which torch refuses to modify in place), and the gradient
order of lookups around reentrant checkpoints (their inner backward passes accumulate in
the middle of the outer one). Reference: a dense ``nn.Embedding`` on the same device, the
same rows, trained by the same torch optimizer; compared bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gadgetloader as gl

N, D = 40, 8


def _pair(placement: str, device: torch.device, seed: int = 0):
    w = torch.randn(N, D, generator=torch.Generator().manual_seed(seed))
    off = gl.OffloadedEmbedding(N, D, placement, device=device)
    off.load_state_dict({"weight": w})
    ref = nn.Embedding(N, D).to(device)
    with torch.no_grad():
        ref.weight.copy_(w)
    return off, ref


def _table(m: nn.Module) -> torch.Tensor:
    if isinstance(m, gl.OffloadedEmbedding):
        return m.weight.as_tensor().cpu()
    return m.weight.detach().cpu()


def _inplace(out: torch.Tensor, kind: str, step: int) -> torch.Tensor:
    if kind == "mul_":
        out.mul_(2.5)
    elif kind == "relu_":
        out.relu_()
    elif kind == "slice":
        out[:, 0] = 0.0
        out[1].zero_()
    else:
        torch.manual_seed(step)
        nn.functional.dropout(out, 0.5, training=True, inplace=True)
    return out


@pytest.mark.parametrize("kind", ["mul_", "relu_", "slice", "dropout"])
def test_in_place_ops_on_the_output_train_like_nn_embedding(placement, device, kind):
    off, ref = _pair(placement, device)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        ids = torch.randint(0, N, (6, 3), generator=gen).to(device)
        for emb, o in ((off, opt), (ref, ref_opt)):
            out = _inplace(emb(ids), kind, step)
            assert out.shape == (6, 3, D)
            (out * torch.arange(D, device=device)).square().sum().backward()
            o.step()
            o.zero_grad()
        assert torch.equal(_table(off), _table(ref)), (kind, step)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoints_between_lookups_sum_like_nn_embedding(placement, device, reentrant):
    """``loss = A + ckpt(L1) + B + ckpt(L2)`` with coefficients of very different sizes: a
    dense weight gets each reentrant checkpoint's inner pass when it runs and the outer
    pass's sum when its last lookup's gradient arrives; any other order rounds
    differently."""
    ids = torch.tensor([1, 2, 3, 3], device=device)
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(4, D, generator=gen) * 1e8
    ca, cb = torch.randn(4, D, generator=gen), torch.randn(4, D, generator=gen)
    c1, c2 = -big + torch.randn(4, D, generator=gen), big
    ca, cb, c1, c2 = (c.to(device) for c in (ca, cb, c1, c2))
    off, ref = _pair(placement, device)
    for emb in (off, ref):
        emb.load_state_dict({"weight": torch.zeros(N, D, device=device)})
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=1.0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1.0)
    for emb, o in ((off, opt), (ref, ref_opt)):
        x = torch.ones(1, device=device, requires_grad=True)

        def inner(i, x, c, e=emb):
            return (e(i) * c * x).sum()

        loss = (
            (emb(ids) * ca).sum()
            + checkpoint(inner, ids, x, c1, use_reentrant=reentrant)
            + (emb(ids) * cb).sum()
            + checkpoint(inner, ids, x, c2, use_reentrant=reentrant)
        )
        loss.backward()
        o.step()
    assert torch.equal(_table(off), _table(ref))
