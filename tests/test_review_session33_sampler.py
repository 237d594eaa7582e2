"""Black-box review (session 33): GadgetSampler / GadgetLoader's sampler as a mathematical object.

Written from README.md ("Input pipeline", "Resume", "Ranks"), SPEC.md and the public docstrings
of GadgetSampler / GadgetLoader only. Property tests use hypothesis with modest example counts.
"""

from __future__ import annotations

import contextlib
import copy
import math
import pickle
from collections import Counter

import numpy as np
import pytest
import torch

import gadgetloader as gl

hypothesis = pytest.importorskip("hypothesis")
# hypothesis imports libcst when it reports a failing example; libcst warns a DeprecationWarning on
# import, which filterwarnings="error" turns into an INTERNALERROR of the whole session. Import it
# here, warnings silenced, so that a failing property is reported as a normal failure.
import warnings  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    with contextlib.suppress(Exception):  # (an optional part of hypothesis)
        import hypothesis.extra._patching  # noqa: F401


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "is_available", lambda: False)
    yield
    mp.undo()


SETTINGS = dict(
    deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True, database=None
)

ORDERS = ("sequential", "random", "chunk")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def make(n, cfg, rank=None, **over):
    kw = dict(
        batch_size=cfg["B"],
        order=cfg["order"],
        drop_last=cfg["mode"] == "drop_last",
        pad=cfg["mode"] == "pad",
        seed=cfg["seed"],
        chunk_rows=cfg["C"],
        window_chunks=cfg["W"],
        num_replicas=cfg["R"],
        rank=cfg.get("rank", 0) if rank is None else rank,
    )
    kw.update(over)
    return gl.GadgetSampler(n, **kw)


def ids(batches):
    return [b.tolist() for b in batches]


def draw(it, k):
    return [next(it).clone() for _ in range(k)]


@st.composite
def configs(draw_, max_n=100, max_b=12, modes=("default", "drop_last", "pad")):
    n = draw_(st.integers(1, max_n))
    R = draw_(st.integers(1, min(4, n)))
    B = draw_(st.integers(1, max_b))
    mode = draw_(st.sampled_from(modes))
    if mode == "drop_last" and n < R * B:
        B = max(1, n // R)
    order = draw_(st.sampled_from(ORDERS))
    C = draw_(st.integers(1, 12))
    W = draw_(st.integers(1, 5))
    seed = draw_(st.one_of(st.integers(0, 2**16), st.just(2**64 - 1)))
    epoch = draw_(st.integers(0, 6))
    return dict(n=n, R=R, B=B, mode=mode, order=order, C=C, W=W, seed=seed, epoch=epoch)


def expected_len(n, R, B, mode):
    if mode == "drop_last":
        return n // (R * B)
    if mode == "pad":
        return math.ceil(n / (R * B))
    return math.ceil((n // R) / B)


def check_chunk_windows(order, n, C, W):
    """Each window of W chunks (the last may hold fewer) occupies consecutive positions and holds
    whole chunks only (README: chunks shuffled, rows shuffled within windows of window_chunks chunks)."""
    num_chunks = math.ceil(n / C)
    sizes = {c: min(C, n - c * C) for c in range(num_chunks)}
    got = Counter()
    window, done, windows = set(), set(), []
    for p, row in enumerate(order):
        c = row // C
        assert c not in done, f"chunk {c} requested again at position {p}, after its window ended"
        window.add(c)
        got[c] += 1
        assert len(window) <= W, (
            f"window at position {p} draws from {len(window)} chunks > window_chunks={W}"
        )
        if all(got[x] == sizes[x] for x in window) and (
            len(window) == W or len(done) + len(window) == num_chunks
        ):
            windows.append(window)
            done |= window
            window = set()
    assert not window, f"chunks {sorted(window)} not completed at the end of the epoch"
    assert done == set(range(num_chunks))
    return windows


# ---------------------------------------------------------------------------------------------
# partition / padding / dropping rules, over all ranks
# ---------------------------------------------------------------------------------------------


@settings(max_examples=150, **SETTINGS)
@given(cfg=configs())
def test_epoch_partition_rules_over_all_ranks(cfg):
    n, R, B, mode, epoch = cfg["n"], cfg["R"], cfg["B"], cfg["mode"], cfg["epoch"]
    samplers = [make(n, cfg, rank=r) for r in range(R)]
    L = expected_len(n, R, B, mode)
    per_rank = []
    for r, s in enumerate(samplers):
        s.set_epoch(epoch)
        assert len(s) == L, (r, len(s), L)
        batches = [b.clone() for b in s]
        assert len(batches) == len(s), (
            f"rank {r}: len()={len(s)} but {len(batches)} batches were yielded"
        )
        for b in batches:
            assert b.dtype == torch.int64 and b.dim() == 1
        per_rank.append(batches)

    order = samplers[0].epoch_order(epoch)
    assert order.dtype == torch.int64
    assert sorted(order.tolist()) == list(range(n)), "epoch_order must be a permutation of the rows"
    for s in samplers[1:]:
        assert torch.equal(s.epoch_order(epoch), order), "every rank must share one epoch order"
    if cfg["order"] == "sequential":
        assert order.tolist() == list(range(n))

    flat = [torch.cat(bs).tolist() if bs else [] for bs in per_rank]
    everything = [x for f in flat for x in f]
    if mode == "default":
        assert sorted(everything) == list(range(n)), (
            "every row exactly once per epoch over all ranks"
        )
        q, extra = divmod(n, R)
        start = 0
        for r in range(R):
            share = q + (1 if r < extra else 0)
            assert flat[r] == order[start : start + share].tolist(), (
                f"rank {r} is not its contiguous share"
            )
            start += share
            sizes = [len(b) for b in per_rank[r]]
            assert all(x == B for x in sizes[:-1]), sizes
            assert 1 <= sizes[-1] <= B + 1, sizes
            if sizes[-1] == B + 1:
                assert q % B == 0 and r < extra, (sizes, q, r)
    elif mode == "drop_last":
        for r in range(R):
            assert all(len(b) == B for b in per_rank[r])
        assert everything == order[: R * L * B].tolist(), (
            "drop_last must drop exactly the epoch order's tail"
        )
        assert len(set(everything)) == len(everything)
        assert n - len(everything) == n % (R * B)
    else:  # pad
        for r in range(R):
            assert all(len(b) == B for b in per_rank[r])
        total = R * L * B
        assert everything == order[torch.arange(total) % n].tolist(), (
            "pad must repeat rows cyclically from the start of the epoch order"
        )


@settings(max_examples=40, **SETTINGS)
@given(cfg=configs())
def test_same_number_of_batches_on_every_rank_and_in_len(cfg):
    n, R = cfg["n"], cfg["R"]
    counts = []
    for r in range(R):
        s = make(n, cfg, rank=r)
        s.set_epoch(cfg["epoch"])
        counts.append((len(s), sum(1 for _ in s)))
    assert len({c for pair in counts for c in pair}) == 1, counts


def test_docstring_examples_exact():
    assert ids(gl.GadgetSampler(10, batch_size=4, order="sequential")) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
    ]
    got = [
        ids(gl.GadgetSampler(9, batch_size=2, order="sequential", num_replicas=2, rank=r))
        for r in (0, 1)
    ]
    assert got == [[[0, 1], [2, 3, 4]], [[5, 6], [7, 8]]]


def test_pad_with_fewer_rows_than_ranks_repeats_rows_cyclically():
    # "(or more often where the missing rows outnumber the rows)"
    got = [
        ids(gl.GadgetSampler(3, batch_size=2, pad=True, order="sequential", num_replicas=4, rank=r))
        for r in range(4)
    ]
    flat = [x for rank in got for b in rank for x in b]
    assert flat == [i % 3 for i in range(8)]
    assert all(len(b) == 2 for rank in got for b in rank)


# ---------------------------------------------------------------------------------------------
# determinism, epochs and set_epoch
# ---------------------------------------------------------------------------------------------


@settings(max_examples=40, **SETTINGS)
@given(cfg=configs(), rank_pick=st.integers(0, 3))
def test_deterministic_for_seed_and_independent_of_build_history(cfg, rank_pick):
    rank = rank_pick % cfg["R"]
    a = make(cfg["n"], cfg, rank=rank)
    b = make(cfg["n"], cfg, rank=rank)
    # b wanders through other epochs first; set_epoch must still give the same batches
    b.set_epoch(cfg["epoch"] + 3)
    list(b)
    a.set_epoch(cfg["epoch"])
    b.set_epoch(cfg["epoch"])
    assert ids(a) == ids(b)
    assert torch.equal(a.epoch_order(cfg["epoch"]), b.epoch_order(cfg["epoch"]))


@settings(max_examples=30, **SETTINGS)
@given(cfg=configs(modes=("default", "pad")))
def test_chunk_options_do_not_change_random_or_sequential(cfg):
    if cfg["order"] == "chunk":
        cfg = dict(cfg, order="random")
    with_opts = make(cfg["n"], cfg)
    without = make(cfg["n"], cfg, chunk_rows=None, window_chunks=None)
    for s in (with_opts, without):
        s.set_epoch(cfg["epoch"])
    assert ids(with_opts) == ids(without)


@settings(max_examples=30, **SETTINGS)
@given(cfg=configs(max_n=80))
def test_epochs_advance_by_themselves_and_match_set_epoch(cfg):
    n = cfg["n"]
    s = make(n, cfg)
    assert s.epoch == 0
    passes = []
    for e in range(3):
        assert s.epoch == e
        passes.append(ids(s))
    assert s.epoch == 3
    for e in range(3):
        ref = make(n, cfg)
        ref.set_epoch(e)
        assert ids(ref) == passes[e], f"auto-advanced pass {e} differs from set_epoch({e})"
    # DistributedSampler-style loop: set_epoch at the top of every epoch gives the same result
    d = make(n, cfg)
    for e in range(3):
        d.set_epoch(e)
        assert ids(d) == passes[e]


@settings(max_examples=30, **SETTINGS)
@given(cfg=configs(max_n=80), k=st.integers(0, 50))
def test_breaking_early_restarts_the_same_epoch(cfg, k):
    s = make(cfg["n"], cfg)
    s.set_epoch(cfg["epoch"])
    ref = make(cfg["n"], cfg)
    ref.set_epoch(cfg["epoch"])
    full = ids(ref)
    if not full:
        return
    k = k % len(full)  # strictly fewer than all batches
    it = iter(s)
    got = [next(it).tolist() for _ in range(k)]
    assert got == full[:k]
    del it
    assert s.epoch == cfg["epoch"], "an unfinished pass must not advance the epoch"
    assert ids(s) == full, "a new iter() before the pass ends restarts the current epoch"
    assert s.epoch == cfg["epoch"] + 1


@settings(max_examples=25, **SETTINGS)
@given(
    n=st.integers(16, 120),
    B=st.integers(1, 16),
    order=st.sampled_from(("random", "chunk")),
    C=st.integers(1, 12),
    W=st.integers(1, 5),
    seed=st.integers(0, 2**32),
)
def test_shuffled_orders_differ_between_epochs_and_seeds(n, B, order, C, W, seed):
    s = gl.GadgetSampler(n, batch_size=B, order=order, chunk_rows=C, window_chunks=W, seed=seed)
    o0, o1, o2 = (s.epoch_order(e) for e in range(3))
    assert not torch.equal(o0, o1) and not torch.equal(o1, o2), "a new shuffle every epoch"
    other = gl.GadgetSampler(
        n, batch_size=B, order=order, chunk_rows=C, window_chunks=W, seed=seed + 1
    )
    assert not torch.equal(o0, other.epoch_order(0)), "different seeds should give different orders"


def test_sequential_is_the_same_every_epoch():
    s = gl.GadgetSampler(23, batch_size=5, order="sequential", seed=7)
    first = ids(s)
    for _ in range(3):
        assert ids(s) == first
    assert [x for b in first for x in b] == list(range(23))


def test_epoch_order_defaults_to_current_epoch():
    s = gl.GadgetSampler(40, batch_size=6, seed=3)
    s.set_epoch(4)
    assert torch.equal(s.epoch_order(), s.epoch_order(4))
    assert torch.cat(list(s)).tolist() == s.epoch_order(4).tolist()


# ---------------------------------------------------------------------------------------------
# chunk order
# ---------------------------------------------------------------------------------------------


@settings(max_examples=50, **SETTINGS)
@given(
    n=st.integers(1, 150),
    B=st.integers(1, 10),
    C=st.integers(1, 16),
    W=st.integers(1, 6),
    seed=st.integers(0, 2**40),
    epoch=st.integers(0, 5),
)
def test_chunk_order_reads_each_chunk_within_one_window(n, B, C, W, seed, epoch):
    s = gl.GadgetSampler(n, batch_size=B, order="chunk", chunk_rows=C, window_chunks=W, seed=seed)
    assert s.chunk_rows == C and s.window_chunks == W
    order = s.epoch_order(epoch).tolist()
    assert sorted(order) == list(range(n))
    check_chunk_windows(order, n, C, W)
    # every chunk's rows lie within one window of window_chunks * chunk_rows consecutive positions
    pos = {row: p for p, row in enumerate(order)}
    for c in range(math.ceil(n / C)):
        ps = [pos[r] for r in range(c * C, min(n, (c + 1) * C))]
        assert max(ps) - min(ps) < W * C


@settings(max_examples=25, **SETTINGS)
@given(n=st.integers(1, 3000), B=st.integers(1, 64), C=st.integers(1, 300))
def test_chunk_default_window_holds_16_batches_and_8_chunks(n, B, C):
    s = gl.GadgetSampler(n, batch_size=B, order="chunk", chunk_rows=C)
    # "Default: enough chunks to hold 16 batches, and at least 8."
    assert s.window_chunks == max(8, math.ceil(16 * B / C))
    assert s.window_chunks * C >= 16 * B
    check_chunk_windows(s.epoch_order(0).tolist(), n, C, s.window_chunks)


def test_chunk_order_needs_a_chunk_size():
    with pytest.raises(gl.GadgetValueError, match="chunk_rows"):
        gl.GadgetSampler(10, batch_size=2, order="chunk")


def test_chunk_rows_taken_from_a_file_backed_dataset(tmp_path):
    h5py = pytest.importorskip("h5py")
    path = tmp_path / "x.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("a", data=np.arange(100, dtype=np.float32).reshape(50, 2), chunks=(7, 2))
    ds = gl.GadgetDataset(str(path), np.arange(50), placement="file", device="cpu")
    try:
        s = gl.GadgetSampler(ds, batch_size=3, order="chunk", window_chunks=2, seed=1)
        assert s.chunk_rows == 7
        check_chunk_windows(s.epoch_order(0).tolist(), 50, 7, 2)
        # the batches through the dataset are the rows of the sampler's ids
        loader = gl.GadgetLoader(
            ds, sampler=gl.GadgetSampler(ds, batch_size=3, order="chunk", window_chunks=2, seed=1)
        )
        got = [b[1].tolist() for b in loader]
        assert got == ids(
            gl.GadgetSampler(ds, batch_size=3, order="chunk", window_chunks=2, seed=1)
        )
    finally:
        ds.close()


# ---------------------------------------------------------------------------------------------
# state_dict / load_state_dict
# ---------------------------------------------------------------------------------------------


@settings(max_examples=30, **SETTINGS)
@given(cfg=configs(max_n=50, max_b=8), other_seed=st.integers(0, 1000), rank_pick=st.integers(0, 3))
def test_state_at_every_position_resumes_exactly_the_remainder(cfg, other_seed, rank_pick):
    n, R, epoch = cfg["n"], cfg["R"], cfg["epoch"]
    saver_rank = 0
    loader_rank = (
        rank_pick % R
    )  # "A state saved on one rank can be loaded on any rank of the same world size"
    ref = make(n, cfg, rank=loader_rank)
    ref.set_epoch(epoch)
    full = ids(ref)
    nxt = ids(ref)  # epoch + 1
    ref_saver = make(n, cfg, rank=saver_rank)
    ref_saver.set_epoch(epoch)
    full_saver = ids(ref_saver)
    L = len(full)
    for k in range(L + 1):
        s = make(n, cfg, rank=saver_rank)
        s.set_epoch(epoch)
        it = iter(s)
        assert ids(draw(it, k)) == full_saver[:k]
        state = s.state_dict()
        state = pickle.loads(pickle.dumps(state))  # a state must survive a checkpoint round trip
        fresh = make(n, cfg, rank=loader_rank, seed=other_seed)
        fresh.load_state_dict(state)
        assert fresh.seed == cfg["seed"], "a loaded state brings its seed"
        iter(fresh)  # an iter() that draws nothing does not move the loaded position
        rem = ids(fresh)
        assert rem == full[k:], f"resume at batch {k} of {L}"
        assert ids(fresh) == nxt, "after the resumed pass comes the next epoch"
        # the saver's own pass still goes on from where it was
        assert ids(it) == full_saver[k:]


@settings(max_examples=20, **SETTINGS)
@given(cfg=configs(max_n=60, max_b=8), k=st.integers(0, 40))
def test_state_dict_is_a_snapshot_not_a_live_view(cfg, k):
    s = make(cfg["n"], cfg)
    s.set_epoch(cfg["epoch"])
    it = iter(s)
    k = k % (len(s) + 1)
    draw(it, k)
    state = s.state_dict()
    frozen = copy.deepcopy(state)
    list(it)
    s.set_epoch(cfg["epoch"] + 5)
    assert state == frozen, "state_dict() must not change after it was returned"


def _variants(cfg):
    """Settings that a state must be refused for (README: dataset size, world size, batch size,
    order, drop_last / pad, chunk layout)."""
    n, R, B = cfg["n"], cfg["R"], cfg["B"]
    out = []
    drop = cfg["mode"] == "drop_last"
    pad = cfg["mode"] == "pad"
    n2 = n + 1 if not drop or n + 1 >= R * B else n - 1
    if n2 >= R and n2 >= 1 and not (drop and n2 < R * B):
        out.append(("num_rows", n2, {}))
    if n >= R + 1 and not (drop and n < (R + 1) * B):
        out.append(("num_replicas", n, dict(num_replicas=R + 1, rank=0)))
    if not (drop and n < R * (B + 1)):
        out.append(("batch_size", n, dict(batch_size=B + 1)))
    for o in ORDERS:
        if o != cfg["order"]:
            out.append(("order", n, dict(order=o)))
    if not drop and n >= R * B:
        out.append(("drop_last", n, dict(drop_last=True, pad=False)))
    if drop:
        out.append(("drop_last", n, dict(drop_last=False)))
    out.append(("pad", n, dict(pad=not pad, drop_last=False)))
    if cfg["order"] == "chunk":
        out.append(("chunk_rows", n, dict(chunk_rows=cfg["C"] + 1)))
        out.append(("window_chunks", n, dict(window_chunks=cfg["W"] + 1)))
    return out


@settings(max_examples=25, **SETTINGS)
@given(cfg=configs(max_n=60, max_b=6), k=st.integers(0, 30), j=st.integers(0, 30))
def test_foreign_state_is_refused_and_sampler_unchanged(cfg, k, j):
    n = cfg["n"]
    src = make(n, cfg)
    src.set_epoch(cfg["epoch"])
    it = iter(src)
    draw(it, k % (len(src) + 1))
    state = src.state_dict()
    for field, n2, over in _variants(cfg):

        def build(n2=n2, over=over):
            t = make(n2, cfg, **over)
            t.set_epoch(2)
            # give the target a loaded (not yet drawn) position of its own
            own = make(n2, cfg, **over)
            own.set_epoch(2)
            oit = iter(own)
            draw(oit, j % (len(own) + 1))
            t.load_state_dict(own.state_dict())
            return t

        target, control = build(), build()
        before = copy.deepcopy(target.state_dict())
        with pytest.raises(gl.GadgetValueError) as ei:
            target.load_state_dict(state)
        msg = str(ei.value)
        named = {
            "num_rows": ("num_rows", "size"),
            "num_replicas": ("num_replicas", "world size"),
        }.get(field, (field,))
        assert any(w in msg for w in named + tuple(over)), (field, over, msg)
        assert target.state_dict() == before, f"refused state ({field}) changed the sampler's state"
        assert target.epoch == control.epoch and target.seed == control.seed
        assert ids(target) == ids(control), (
            f"refused state ({field}) changed what the sampler yields"
        )
        assert ids(target) == ids(control)


def test_refusal_messages_name_both_values():
    base = gl.GadgetSampler(10, batch_size=3, seed=5).state_dict()
    with pytest.raises(gl.GadgetValueError) as ei:
        gl.GadgetSampler(10, batch_size=4).load_state_dict(base)
    assert "3" in str(ei.value) and "4" in str(ei.value) and "batch_size" in str(ei.value)
    with pytest.raises(gl.GadgetValueError) as ei:
        gl.GadgetSampler(11, batch_size=3).load_state_dict(base)
    assert "10" in str(ei.value) and "11" in str(ei.value)


@pytest.mark.parametrize(
    "patch, exc",
    [
        (dict(position=-1), gl.GadgetValueError),
        (dict(position=99), gl.GadgetValueError),
        (dict(position=1.5), gl.GadgetTypeError),
        (dict(position=True), gl.GadgetTypeError),
        (dict(epoch=-1), gl.GadgetValueError),
        (dict(epoch="1"), gl.GadgetTypeError),
        (dict(seed=-3), gl.GadgetValueError),
        (dict(seed=2**64), gl.GadgetValueError),
        (dict(version=99), gl.GadgetValueError),
    ],
)
def test_corrupt_state_values_refused_sampler_unchanged(patch, exc):
    src = gl.GadgetSampler(10, batch_size=3, seed=5)
    it = iter(src)
    next(it)
    bad = dict(src.state_dict(), **patch)
    t = gl.GadgetSampler(10, batch_size=3, seed=9)
    t.set_epoch(2)
    before = t.state_dict()
    with pytest.raises(exc) as ei:
        t.load_state_dict(bad)
    key = next(iter(patch))
    assert key in str(ei.value), str(ei.value)
    assert t.state_dict() == before
    ref = gl.GadgetSampler(10, batch_size=3, seed=9)
    ref.set_epoch(2)
    assert ids(t) == ids(ref)


@pytest.mark.parametrize(
    "bad, exc",
    [([1, 2], gl.GadgetTypeError), (None, gl.GadgetTypeError), ({}, gl.GadgetValueError)],
)
def test_state_that_is_not_a_sampler_state_refused(bad, exc):
    t = gl.GadgetSampler(10, batch_size=3, seed=9)
    before = t.state_dict()
    with pytest.raises(exc):
        t.load_state_dict(bad)
    assert t.state_dict() == before


def test_state_accepts_read_only_mapping():
    import types

    s = gl.GadgetSampler(12, batch_size=3, seed=2)
    it = iter(s)
    next(it)
    st_ = types.MappingProxyType(dict(s.state_dict()))
    t = gl.GadgetSampler(12, batch_size=3, seed=0)
    t.load_state_dict(st_)
    assert ids(t) == ids(it)


def test_set_epoch_of_loaded_epoch_keeps_position_other_epoch_restarts():
    s = gl.GadgetSampler(20, batch_size=3, seed=11)
    s.set_epoch(4)
    full = ids(s)
    s.set_epoch(4)
    it = iter(s)
    draw(it, 2)
    state = s.state_dict()
    t = gl.GadgetSampler(20, batch_size=3, seed=11)
    t.load_state_dict(state)
    t.set_epoch(4)  # DistributedSampler loop: the resumed epoch keeps the loaded position
    assert ids(t) == full[2:]
    u = gl.GadgetSampler(20, batch_size=3, seed=11)
    u.load_state_dict(state)
    u.set_epoch(5)
    ref = gl.GadgetSampler(20, batch_size=3, seed=11)
    ref.set_epoch(5)
    assert ids(u) == ids(ref)


def test_loaded_position_holds_for_every_iter_until_a_batch_is_drawn():
    s = gl.GadgetSampler(20, batch_size=3, seed=1)
    full = ids(gl.GadgetSampler(20, batch_size=3, seed=1))
    it = iter(s)
    draw(it, 3)
    t = gl.GadgetSampler(20, batch_size=3, seed=1)
    t.load_state_dict(s.state_dict())
    for _ in range(3):
        iter(t)
    it2 = iter(t)
    assert next(it2).tolist() == full[3]
    # a batch was drawn: the next iter() restarts the epoch
    assert ids(t) == full


@pytest.mark.parametrize(
    "bad, exc",
    [
        (-1, gl.GadgetValueError),
        (1.5, gl.GadgetTypeError),
        (True, gl.GadgetTypeError),
        ("2", gl.GadgetTypeError),
        (2**64, gl.GadgetValueError),
    ],
)
def test_set_epoch_bad_values_refused_unchanged(bad, exc):
    s = gl.GadgetSampler(10, batch_size=3, seed=1)
    s.set_epoch(3)
    before = s.state_dict()
    with pytest.raises(exc) as ei:
        s.set_epoch(bad)
    assert "epoch" in str(ei.value)
    assert s.state_dict() == before and s.epoch == 3


# ---------------------------------------------------------------------------------------------
# pickling
# ---------------------------------------------------------------------------------------------


@settings(max_examples=25, **SETTINGS)
@given(cfg=configs(max_n=60, max_b=8), k=st.integers(0, 40), rank_pick=st.integers(0, 3))
def test_pickling_a_sampler_mid_epoch(cfg, k, rank_pick):
    rank = rank_pick % cfg["R"]
    s = make(cfg["n"], cfg, rank=rank)
    s.set_epoch(cfg["epoch"])
    ref = make(cfg["n"], cfg, rank=rank)
    ref.set_epoch(cfg["epoch"])
    full = ids(ref)
    nxt = ids(ref)
    L = len(full)
    k = k % (L + 1)
    it = iter(s)
    draw(it, k)
    for u in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s)):
        assert (u.rank, u.num_replicas, u.seed, u.batch_size, u.order) == (
            rank,
            cfg["R"],
            cfg["seed"],
            cfg["B"],
            cfg["order"],
        ), "a pickled sampler keeps its rank and settings"
        assert u.state_dict() == s.state_dict()
        assert len(u) == len(s)
        # the copy's new pass behaves as the original's would (restart an unfinished epoch)
        if k == L and L > 0:
            assert ids(u) == nxt
        else:
            assert ids(u) == full
    # the original's pass is unaffected by the pickling
    assert ids(it) == full[k:]


def test_pickled_sampler_keeps_a_loaded_position():
    s = gl.GadgetSampler(20, batch_size=3, seed=1, num_replicas=2, rank=1)
    full = ids(gl.GadgetSampler(20, batch_size=3, seed=1, num_replicas=2, rank=1))
    it = iter(s)
    draw(it, 2)
    t = gl.GadgetSampler(20, batch_size=3, seed=8, num_replicas=2, rank=1)
    t.load_state_dict(s.state_dict())
    u = pickle.loads(pickle.dumps(t))
    assert u.rank == 1
    assert ids(u) == full[2:] == ids(t)


# ---------------------------------------------------------------------------------------------
# bad arguments
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, exc, words",
    [
        (dict(batch_size=0), gl.GadgetValueError, ("batch_size", "0")),
        (dict(batch_size=-3), gl.GadgetValueError, ("batch_size", "-3")),
        (dict(batch_size=2.0), gl.GadgetTypeError, ("batch_size", "float")),
        (dict(batch_size=True), gl.GadgetTypeError, ("batch_size", "bool")),
        (dict(batch_size="4"), gl.GadgetTypeError, ("batch_size", "str")),
        (dict(batch_size=None), gl.GadgetTypeError, ("batch_size",)),
        (dict(batch_size=2, num_replicas=2, rank=2), gl.GadgetValueError, ("rank", "2")),
        (dict(batch_size=2, num_replicas=2, rank=-1), gl.GadgetValueError, ("rank", "-1")),
        (dict(batch_size=2, num_replicas=0, rank=0), gl.GadgetValueError, ("num_replicas", "0")),
        (dict(batch_size=2, num_replicas=-2, rank=0), gl.GadgetValueError, ("num_replicas", "-2")),
        (
            dict(batch_size=2, num_replicas=2.0, rank=0),
            gl.GadgetTypeError,
            ("num_replicas", "float"),
        ),
        (dict(batch_size=2, num_replicas=2, rank=1.0), gl.GadgetTypeError, ("rank", "float")),
        (dict(batch_size=2, num_replicas=2, rank=True), gl.GadgetTypeError, ("rank", "bool")),
        (dict(batch_size=2, num_replicas=2), gl.GadgetValueError, ("rank",)),
        (dict(batch_size=2, seed=-1), gl.GadgetValueError, ("seed", "-1")),
        (dict(batch_size=2, seed=2**64), gl.GadgetValueError, ("seed",)),
        (dict(batch_size=2, seed=0.5), gl.GadgetTypeError, ("seed", "float")),
        (dict(batch_size=2, seed=False), gl.GadgetTypeError, ("seed", "bool")),
        (
            dict(batch_size=2, order="shuffle"),
            gl.GadgetKeyError,
            ("shuffle", "random", "sequential", "chunk"),
        ),
        (dict(batch_size=2, order=3), gl.GadgetError, ("order",)),
        (dict(batch_size=2, drop_last="no"), gl.GadgetTypeError, ("drop_last",)),
        (dict(batch_size=2, pad=2), gl.GadgetTypeError, ("pad",)),
        (dict(batch_size=2, pad=True, drop_last=True), gl.GadgetValueError, ("drop_last", "pad")),
        (dict(batch_size=2, window_chunks=0), gl.GadgetValueError, ("window_chunks", "0")),
        (dict(batch_size=2, window_chunks=1.5), gl.GadgetTypeError, ("window_chunks", "float")),
        (dict(batch_size=2, chunk_rows=-1), gl.GadgetValueError, ("chunk_rows", "-1")),
        (dict(batch_size=2, chunk_rows="8"), gl.GadgetTypeError, ("chunk_rows", "str")),
        (dict(batch_size=2, coalesce=0), gl.GadgetValueError, ("coalesce", "0")),
        (dict(batch_size=2, coalesce=2.0), gl.GadgetTypeError, ("coalesce",)),
    ],
)
def test_bad_sampler_arguments(kw, exc, words):
    with pytest.raises(exc) as ei:
        gl.GadgetSampler(10, **kw)
    msg = str(ei.value)
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize(
    "src, exc",
    [
        (0, gl.GadgetValueError),
        (-5, gl.GadgetValueError),
        (3.0, gl.GadgetTypeError),
        (None, gl.GadgetTypeError),
        (True, gl.GadgetTypeError),
        ("rows.npy", gl.GadgetTypeError),
    ],
)
def test_bad_data_source(src, exc):
    with pytest.raises(exc):
        gl.GadgetSampler(src, batch_size=2)


def test_zero_dim_tensor_data_source_gives_a_gadget_error():
    # data_source: "The number of rows, or anything with len()". A 0-d tensor is neither; the
    # README: "Every error the library raises derives from gl.GadgetError" and says what was
    # expected. Accepting it as a count (as NumPy integer scalars are) would also be fine.
    try:
        s = gl.GadgetSampler(torch.tensor(5), batch_size=2)
    except gl.GadgetTypeError as e:
        assert "data_source" in str(e)
    else:
        assert s.num_rows == 5 and len(s) == 3


def test_numpy_integers_act_as_ints():
    a = gl.GadgetSampler(
        np.int64(17),
        batch_size=np.int32(4),
        seed=np.uint64(3),
        num_replicas=np.int64(2),
        rank=np.int8(1),
    )
    b = gl.GadgetSampler(17, batch_size=4, seed=3, num_replicas=2, rank=1)
    assert ids(a) == ids(b) and len(a) == len(b)
    assert isinstance(a.batch_size, int) and isinstance(a.num_rows, int)


def test_too_few_rows_for_ranks_or_drop_last_refused():
    with pytest.raises(gl.GadgetValueError) as ei:
        gl.GadgetSampler(3, batch_size=1, num_replicas=4, rank=0)
    assert "3" in str(ei.value) and "4" in str(ei.value)
    with pytest.raises(gl.GadgetValueError) as ei:
        gl.GadgetSampler(7, batch_size=4, drop_last=True, num_replicas=2, rank=1)
    assert "7" in str(ei.value) and "drop_last" in str(ei.value)
    assert len(gl.GadgetSampler(8, batch_size=4, drop_last=True, num_replicas=2, rank=1)) == 1


def test_epoch_order_bad_epoch():
    s = gl.GadgetSampler(10, batch_size=2)
    with pytest.raises(gl.GadgetValueError):
        s.epoch_order(-1)
    with pytest.raises(gl.GadgetTypeError):
        s.epoch_order(1.0)


# ---------------------------------------------------------------------------------------------
# the sampler as used by GadgetLoader / DataLoader
# ---------------------------------------------------------------------------------------------


def _ds(n):
    return gl.GadgetDataset(torch.arange(n, dtype=torch.int64), placement="cpu", device="cpu")


def _loader_kwargs(cfg, rank):
    return dict(
        batch_size=cfg["B"],
        order=cfg["order"],
        drop_last=cfg["mode"] == "drop_last",
        pad=cfg["mode"] == "pad",
        seed=cfg["seed"],
        chunk_rows=cfg["C"],
        window_chunks=cfg["W"],
        num_replicas=cfg["R"],
        rank=rank,
    )


@settings(max_examples=25, **SETTINGS)
@given(
    cfg=configs(max_n=60, max_b=8),
    rank_pick=st.integers(0, 3),
    prefetch=st.sampled_from((0, 2)),
    coalesce=st.sampled_from((None, 1, 3)),
)
def test_loader_batches_are_the_samplers_batches(cfg, rank_pick, prefetch, coalesce):
    rank = rank_pick % cfg["R"]
    ds = _ds(cfg["n"])
    loader = gl.GadgetLoader(ds, prefetch=prefetch, coalesce=coalesce, **_loader_kwargs(cfg, rank))
    ref = make(cfg["n"], cfg, rank=rank)
    for epoch in range(2):
        got = [b[0].tolist() for b in loader]
        assert len(got) == len(loader) == len(ref)
        assert got == ids(ref), f"epoch {epoch}"


@settings(max_examples=20, **SETTINGS)
@given(cfg=configs(max_n=40, max_b=6), other_seed=st.integers(0, 99))
def test_loader_state_at_every_position(cfg, other_seed):
    n = cfg["n"]
    ds = _ds(n)
    ref = make(n, cfg)
    full, nxt = ids(ref), ids(ref)
    L = len(full)
    for k in range(L + 1):
        loader = gl.GadgetLoader(ds, prefetch=2, **_loader_kwargs(cfg, 0))
        it = iter(loader)
        got = [next(it)[0].tolist() for _ in range(k)]
        assert got == full[:k]
        state = pickle.loads(pickle.dumps(loader.state_dict()))
        fresh = gl.GadgetLoader(ds, prefetch=2, **dict(_loader_kwargs(cfg, 0), seed=other_seed))
        fresh.load_state_dict(state)
        assert [b[0].tolist() for b in fresh] == full[k:], f"resume at {k} of {L}"
        assert [b[0].tolist() for b in fresh] == nxt
    # saved after the loop ended: points at the next epoch's start
    loader = gl.GadgetLoader(ds, **_loader_kwargs(cfg, 0))
    assert [b[0].tolist() for b in loader] == full
    fresh = gl.GadgetLoader(ds, **dict(_loader_kwargs(cfg, 0), seed=other_seed))
    fresh.load_state_dict(loader.state_dict())
    assert [b[0].tolist() for b in fresh] == nxt


def test_loader_follows_its_samplers_set_epoch_and_state():
    ds = _ds(30)
    s = gl.GadgetSampler(ds, batch_size=4, seed=3, num_replicas=3, rank=2)
    ref = gl.GadgetSampler(30, batch_size=4, seed=3, num_replicas=3, rank=2)
    ref.set_epoch(5)
    expect = ids(ref)
    s.set_epoch(5)
    loader = gl.GadgetLoader(ds, sampler=s)
    assert [b[0].tolist() for b in loader] == expect
    loader.set_epoch(5)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    s2 = gl.GadgetSampler(ds, batch_size=4, seed=0, num_replicas=3, rank=2)
    l2 = gl.GadgetLoader(ds, sampler=s2)
    l2.load_state_dict(state)
    assert [b[0].tolist() for b in l2] == expect[1:]


def test_loader_refuses_foreign_state_unchanged():
    ds = _ds(30)
    src = gl.GadgetLoader(ds, batch_size=4, seed=3)
    it = iter(src)
    next(it)
    state = src.state_dict()
    tgt = gl.GadgetLoader(ds, batch_size=5, seed=3)
    tgt.set_epoch(2)
    before = copy.deepcopy(tgt.state_dict())
    with pytest.raises(gl.GadgetValueError):
        tgt.load_state_dict(state)
    assert tgt.state_dict() == before
    ref = gl.GadgetSampler(30, batch_size=5, seed=3)
    ref.set_epoch(2)
    assert [b[0].tolist() for b in tgt] == ids(ref)


@pytest.mark.parametrize(
    "kw, exc",
    [
        (dict(batch_size=0), gl.GadgetValueError),
        (dict(batch_size=2.5), gl.GadgetTypeError),
        (dict(batch_size=2, num_replicas=2, rank=2), gl.GadgetValueError),
        (dict(batch_size=2, seed=-1), gl.GadgetValueError),
        (dict(batch_size=2, order="nope"), gl.GadgetKeyError),
        (dict(batch_size=2, pad=True, drop_last=True), gl.GadgetValueError),
        (dict(), gl.GadgetValueError),
        (dict(sampler=gl.GadgetSampler(11, batch_size=2)), gl.GadgetValueError),
        (dict(sampler=gl.GadgetSampler(10, batch_size=2), seed=0), gl.GadgetValueError),
        (dict(sampler=gl.GadgetSampler(10, batch_size=2), batch_size=2), gl.GadgetValueError),
        (dict(sampler=gl.GadgetSampler(10, batch_size=2), drop_last=False), gl.GadgetValueError),
        (dict(batch_size=2, shuffle=True), gl.GadgetTypeError),
    ],
)
def test_bad_loader_arguments(kw, exc):
    with pytest.raises(exc):
        gl.GadgetLoader(_ds(10), **kw)


@settings(max_examples=15, **SETTINGS)
@given(cfg=configs(max_n=50, max_b=6), coalesce=st.sampled_from((1, 2, 5)))
def test_dataloader_batch_sampler_form_yields_sampler_batches(cfg, coalesce):
    from torch.utils.data import DataLoader

    ds = _ds(cfg["n"])
    s = make(cfg["n"], cfg, coalesce=coalesce)
    ref = make(cfg["n"], cfg)
    for _ in range(2):
        got = [b[0].tolist() for b in DataLoader(ds, batch_sampler=s)]
        assert got == ids(ref)
    s2 = make(cfg["n"], cfg, coalesce=coalesce)
    got = [b[0].tolist() for b in DataLoader(ds, sampler=s2, batch_size=None)]
    assert got == ids(make(cfg["n"], cfg))


def test_stateful_dataloader_resumes_mid_epoch():
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    ds = _ds(37)
    full = ids(gl.GadgetSampler(37, batch_size=4, seed=6))
    dl = sdl.StatefulDataLoader(ds, batch_sampler=gl.GadgetSampler(37, batch_size=4, seed=6))
    it = iter(dl)
    got = [next(it)[0].tolist() for _ in range(3)]
    assert got == full[:3]
    state = dl.state_dict()
    dl2 = sdl.StatefulDataLoader(ds, batch_sampler=gl.GadgetSampler(37, batch_size=4, seed=0))
    dl2.load_state_dict(state)
    assert [b[0].tolist() for b in dl2] == full[3:]


# ---------------------------------------------------------------------------------------------
# more edges: epoch end without StopIteration, long sequential orders (segments), read-ahead
# ---------------------------------------------------------------------------------------------


@settings(max_examples=25, **SETTINGS)
@given(cfg=configs(max_n=80))
def test_drawing_every_batch_ends_the_epoch_even_without_stopiteration(cfg):
    n = cfg["n"]
    s = make(n, cfg)
    s.set_epoch(cfg["epoch"])
    ref = make(n, cfg)
    ref.set_epoch(cfg["epoch"])
    full, nxt = ids(ref), ids(ref)
    it = iter(s)
    assert ids(draw(it, len(full))) == full
    state = s.state_dict()
    # "After the epoch's last batch was drawn the state reads (epoch, number of batches)"
    assert (state["epoch"], state["position"]) == (cfg["epoch"], len(full))
    # "the next pass starts the next epoch once every batch was drawn from the sampler"
    assert ids(s) == nxt


@pytest.mark.parametrize("R", [1, 3])
@pytest.mark.parametrize("mode", ["default", "pad", "drop_last"])
def test_long_sequential_order_across_segments_with_resume(R, mode):
    n, B = 1001, 2  # several hundred batches: well past a 64-batch segment
    cfg = dict(n=n, R=R, B=B, mode=mode, order="sequential", C=None, W=None, seed=0, epoch=0)
    per_rank = [ids(make(n, cfg, rank=r)) for r in range(R)]
    flat = [x for rank in per_rank for b in rank for x in b]
    L = expected_len(n, R, B, mode)
    assert all(len(p) == L for p in per_rank)
    if mode == "default":
        assert flat == list(range(n))
    elif mode == "pad":
        assert flat == [i % n for i in range(R * L * B)]
    else:
        assert flat == list(range(R * L * B))
    for k in (0, 1, 63, 64, 65, 127, 128, 129, L - 1, L):
        s = make(n, cfg, rank=R - 1)
        draw(iter(s), k)
        t = make(n, cfg, rank=R - 1)
        t.load_state_dict(s.state_dict())
        assert ids(t) == per_rank[R - 1][k:], k


@pytest.mark.parametrize("order", ["sequential", "random"])
@pytest.mark.parametrize("coalesce", [1, 7, 40])
def test_read_ahead_changes_nothing_but_timing(order, coalesce):
    from torch.utils.data import DataLoader

    n = 700
    ds = gl.GadgetDataset(torch.arange(n, dtype=torch.int64) * 3, placement="cpu", device="cpu")
    s = gl.GadgetSampler(ds, batch_size=3, order=order, seed=4, coalesce=coalesce)
    ref = ids(gl.GadgetSampler(n, batch_size=3, order=order, seed=4))
    dl = DataLoader(ds, batch_sampler=s)
    it = iter(dl)
    head = [next(it)[0].tolist() for _ in range(100)]
    assert head == [[3 * x for x in b] for b in ref[:100]]
    state = s.state_dict()
    t = gl.GadgetSampler(ds, batch_size=3, order=order, seed=0, coalesce=coalesce)
    t.load_state_dict(state)
    assert [b[0].tolist() for b in DataLoader(ds, batch_sampler=t)] == [
        [3 * x for x in b] for b in ref[100:]
    ]


@pytest.mark.parametrize(
    "a, b, expect", [(4, 6, 12), (6, 4, 12), (4, 7, 7), (5, 10, 10), (3, 3, 3)]
)
def test_chunk_size_of_columns_with_different_chunks(tmp_path, a, b, expect):
    # "file columns of different chunk sizes are shuffled in chunks of their least common multiple,
    # when that is at most twice the largest, else of the largest"
    h5py = pytest.importorskip("h5py")
    paths = []
    for name, c in (("a.h5", a), ("b.h5", b)):
        p = tmp_path / name
        with h5py.File(p, "w") as f:
            f.create_dataset(
                "x", data=np.arange(120, dtype=np.float32).reshape(60, 2), chunks=(c, 2)
            )
        paths.append(str(p))
    ds = gl.GadgetDataset(*paths, placement="file", device="cpu")
    try:
        s = gl.GadgetSampler(ds, batch_size=2, order="chunk", window_chunks=2, seed=3)
        assert s.chunk_rows == expect
        order = s.epoch_order(1).tolist()
        check_chunk_windows(order, 60, expect, 2)
        s.set_epoch(1)
        got = [bt[0][:, 0].tolist() for bt in gl.GadgetLoader(ds, sampler=s)]
        assert [float(2 * x) for x in order] == [v for batch in got for v in batch]
    finally:
        ds.close()
