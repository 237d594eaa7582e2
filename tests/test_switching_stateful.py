"""A hypothesis state machine: the drop-in module against a plain dense parameter.

Rules train on random batches (repeats, several lookups per step), save and restore
through state_dict() into fresh objects, and the invariant checks after every rule
that the offloaded table equals the dense full-table parameter trained with lazy
per-row updates (Adagrad: state rows outside the batch never change).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 (the torch idiom)
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import gadgetloader as gl

N, D = 16, 3
_ids = st.lists(st.integers(0, N - 1), min_size=1, max_size=12)


class DropInMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.init = torch.linspace(-1, 1, N * D).view(N, D)
        self.W = torch.nn.Parameter(self.init.clone())
        self.ref = torch.optim.Adagrad([self.W], lr=0.1)
        self._build()
        self.steps = 0

    def _build(self, emb_sd=None, opt_sd=None) -> None:
        init = self.init
        self.emb = gl.OffloadedEmbedding(N, D, "cpu", device="cpu", init=lambda t: t.copy_(init))
        self.opt = gl.OffloadedOptimizer(torch.optim.Adagrad, self.emb, lr=0.1)
        if emb_sd is not None:
            self.emb.load_state_dict(emb_sd)
            self.opt.load_state_dict(opt_sd)

    @rule(first=_ids, second=st.one_of(st.none(), _ids))
    def train_step(self, first, second) -> None:
        lookups = [torch.tensor(first)] + ([torch.tensor(second)] if second is not None else [])

        def loss(table_lookup):
            return sum((table_lookup(ids).sin() * (k + 1)).sum() for k, ids in enumerate(lookups))

        self.ref.zero_grad()
        loss(lambda ids: F.embedding(ids, self.W)).backward()
        before = self.W.detach().clone()
        sum_before = self.ref.state[self.W]["sum"].clone()
        self.ref.step()
        with torch.no_grad():
            outside = torch.ones(N, dtype=torch.bool)
            outside[torch.cat(lookups)] = False
            self.W[outside] = before[outside]
            self.ref.state[self.W]["sum"][outside] = sum_before[outside]
        self.opt.zero_grad()
        loss(self.emb).backward()
        self.opt.step()
        self.steps += 1

    @precondition(lambda self: self.steps > 0)
    @rule()
    def save_and_restore(self) -> None:
        emb_sd, opt_sd = self.emb.state_dict(), self.opt.state_dict()
        self._build(emb_sd, opt_sd)

    @invariant()
    def table_matches_dense_parameter(self) -> None:
        got = torch.from_numpy(self.emb.table.getNumpyVersion())
        torch.testing.assert_close(got, self.W.detach(), rtol=1e-5, atol=1e-6)
        state = torch.from_numpy(self.opt.pagers[0].tables["sum"].getNumpyVersion())
        torch.testing.assert_close(state, self.ref.state[self.W]["sum"], rtol=1e-5, atol=1e-6)


DropInMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=8, deadline=None)
TestDropInMachine = DropInMachine.TestCase
