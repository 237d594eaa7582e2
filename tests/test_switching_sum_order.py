"""Several lookups of one table in a step: their gradients are summed in the order torch's
autograd sums the gradients of several uses of one parameter (a dense ``nn.Embedding``'s
weight), so the step equals training the whole table as one parameter bit for bit, not
only for one lookup a step. Within a backward pass torch keeps the first gradient to
arrive and adds each later one to it, in the order its engine runs the lookups' backward
(which depends on the graph: the last lookup first where all are ready, a lookup behind
more operations later); a later pass's sum is added to the gradient already there.

Reference: ``nn.Embedding`` (dense) with the same rows, on the same device, SGD with
``lr=1`` from a zero table, so the table after the step is minus the summed gradient,
every bit of it. Coefficients of very different sizes (2**24 and 1) make any other order
round differently.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import gadgetloader as gl

N, D = 12, 4
BIG = 2.0**24


def _pair(placement: str, device: torch.device) -> tuple[nn.Module, nn.Module, Callable[[], None]]:
    off = gl.OffloadedEmbedding(N, D, placement, device=device)
    off.weight.fill_(0.0)
    ref = nn.Embedding(N, D).to(device)
    nn.init.zeros_(ref.weight)
    o1 = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=1.0)
    o2 = torch.optim.SGD(ref.parameters(), lr=1.0)

    def step() -> None:
        o1.step()
        o2.step()
        o1.zero_grad()
        o2.zero_grad()

    return off, ref, step


def _same(off: nn.Module, ref: nn.Module) -> bool:
    got = off.weight.as_tensor().cpu() if hasattr(off.weight, "as_tensor") else off.weight
    return torch.equal(got.cpu(), ref.weight.detach().cpu())


def _coefs(device: torch.device, seed: int, k: int, n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([1.0, BIG, 3.0, 1 / 3, -BIG, 1.0])
    out = []
    for j in range(k):
        c = torch.randn(n, D, generator=gen) * scale[(j + seed) % len(scale)]
        out.append(c.to(device))
    return out


def _ids(device: torch.device, *rows: list[int]) -> list[torch.Tensor]:
    return [torch.tensor(r, device=device) for r in rows]


# each case: (emb, coefficient tensors, ids) -> loss; several lookups of overlapping rows,
# repeats inside lookups too
def _left_to_right(e, c, ids):  # ((a + b) + c)
    return sum((e(i) * w).sum() for i, w in zip(ids, c, strict=True))


def _right_nested(e, c, ids):  # a + (b + (c + d))
    parts = [(e(i) * w).sum() for i, w in zip(ids, c, strict=True)]
    total = parts[-1]
    for p in reversed(parts[:-1]):
        total = p + total
    return total


def _first_behind_ops(e, c, ids):  # the first lookup's backward waits behind two more ops
    a = torch.tanh(e(ids[0]) * c[0]) * 2.0
    rest = [(e(i) * w).sum() for i, w in zip(ids[1:], c[1:], strict=True)]
    return a.sum() + sum(rest)


def _concatenated(e, c, ids):  # one op joins the lookups
    return (torch.cat([e(i) for i in ids]) * torch.cat(c)).sum()


CASES = {
    "left to right": _left_to_right,
    "right nested": _right_nested,
    "first behind ops": _first_behind_ops,
    "concatenated": _concatenated,
}
ROWS = ([0, 3, 3, 7], [3, 0, 9], [7, 7, 3, 1, 0], [3, 11])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("lookups", [3, 4])
def test_several_lookups_in_one_backward_sum_as_torch_does(
    placement: str, device: torch.device, case: str, lookups: int
) -> None:
    off, ref, step = _pair(placement, device)
    ids = _ids(device, *ROWS[:lookups])
    for seed in range(3):
        c = [w[: len(i)] for w, i in zip(_coefs(device, seed, lookups, 5), ids, strict=True)]
        CASES[case](off, c, ids).backward()
        CASES[case](ref, c, ids).backward()
        step()
        assert _same(off, ref), (case, seed)


@pytest.mark.parametrize(
    "passes", [[1, 3], [2, 2], [3, 1], [1, 1, 2]], ids=["1+3", "2+2", "3+1", "1+1+2"]
)
def test_lookups_over_several_backward_passes_sum_as_torch_does(
    placement: str, device: torch.device, passes: list[int]
) -> None:
    off, ref, step = _pair(placement, device)
    ids = _ids(device, *ROWS)
    for seed in range(2):
        c = [w[: len(ids[j % 4])] for j, w in enumerate(_coefs(device, seed, sum(passes), 5))]
        j = 0
        for count in passes:
            for m in (off, ref):
                _left_to_right(
                    m, c[j : j + count], [ids[(j + k) % 4] for k in range(count)]
                ).backward()
            j += count
        step()
        assert _same(off, ref), (passes, seed)


def test_a_lookup_with_gradient_from_two_passes_still_trains_to_rounding(
    placement: str, device: torch.device
) -> None:
    """One lookup's output used by two backward passes (``retain_graph``): its gradient is
    already a sum, so the order is torch's only up to rounding."""
    off, ref, step = _pair(placement, device)
    ids = _ids(device, *ROWS)
    c = _coefs(device, 5, 4, 5)
    for m in (off, ref):
        shared = m(ids[0])
        (shared * c[0][:4]).sum().backward(retain_graph=True)
        ((shared * c[1][:4]).sum() + (m(ids[1]) * c[2][:3]).sum()).backward()
        (m(ids[2]) * c[3]).sum().backward()
    step()
    got = off.weight.as_tensor().cpu()
    assert torch.allclose(got, ref.weight.detach().cpu(), rtol=1e-6, atol=1e-6 * BIG)
    assert not torch.equal(got, torch.zeros_like(got))


def test_zero_grad_between_backwards_forgets_the_earlier_pass(
    placement: str, device: torch.device
) -> None:
    off, ref, step = _pair(placement, device)
    ids = _ids(device, *ROWS)
    c = [w[: len(i)] for w, i in zip(_coefs(device, 7, 4, 5), ids, strict=True)]
    for m in (off, ref):
        _left_to_right(m, c[:3], ids[:3]).backward()
        m.zero_grad()
        _right_nested(m, c, ids).backward()
    step()
    assert _same(off, ref)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_several_bag_lookups_sum_as_torch_does(
    placement: str, device: torch.device, mode: str
) -> None:
    off = gl.OffloadedEmbeddingBag(N, D, mode=mode, placement=placement, device=device)
    off.weight.fill_(0.0)
    ref = nn.EmbeddingBag(N, D, mode=mode).to(device)
    nn.init.zeros_(ref.weight)
    o1 = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=1.0)
    o2 = torch.optim.SGD(ref.parameters(), lr=1.0)
    bags = [
        torch.tensor([[0, 3, 3], [7, 1, 0]], device=device),
        torch.tensor([[3, 0], [9, 3]], device=device),
        torch.tensor([[7, 7, 3, 1]], device=device),
        torch.tensor([[3, 11, 0]], device=device),
    ]
    for seed in range(3):
        c = [w[: len(b)] for w, b in zip(_coefs(device, seed, 4, 5), bags, strict=True)]
        for m in (off, ref):
            _right_nested(m, c, bags).backward()
        o1.step()
        o2.step()
        o1.zero_grad()
        o2.zero_grad()
        assert _same(off, ref), (mode, seed)
