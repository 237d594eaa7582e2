"""Review (session 10): OffloadedEmbeddingBag against torch's EmbeddingBag, and the
word2vec example as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import gadgetloader as gl
from datasets import word2vec

ROOT = Path(__file__).resolve().parents[1]
ATOL = 1e-6


# --------------------------------------------------------------------------- reference


class LazyRef:
    """The whole table as one parameter, trained by the same torch optimizer with lazy
    per-row updates: each step only the rows looked up move (state rows too), and one
    step count per table (as the README defines)."""

    def __init__(self, weight: torch.Tensor, opt_cls, **kw) -> None:
        self.w = weight.detach().clone()
        self.opt_cls, self.kw = opt_cls, kw
        self.state: dict[str, torch.Tensor] = {}
        self.steps = 0

    def forward(self, mode, inp, offsets=None, psw=None, include_last_offset=False):
        self.p = torch.nn.Parameter(self.w.clone())
        self.ids = inp.reshape(-1).long()
        out = F.embedding_bag(
            inp.long(),
            self.p,
            None if offsets is None else offsets.long(),
            mode=mode,
            per_sample_weights=psw,
            include_last_offset=include_last_offset,
        )
        return out

    def step(self) -> None:
        rows = torch.unique(self.ids)
        if rows.numel() == 0:
            return
        grad = self.p.grad if self.p.grad is not None else torch.zeros_like(self.p)
        q = torch.nn.Parameter(self.w[rows].clone())
        q.grad = grad[rows].clone()
        opt = self.opt_cls([q], **self.kw)
        if self.opt_cls in (torch.optim.Adam, torch.optim.AdamW):
            for k in ("exp_avg", "exp_avg_sq"):
                self.state.setdefault(k, torch.zeros_like(self.w))
            opt.state[q] = {
                "step": torch.tensor(float(self.steps)),
                "exp_avg": self.state["exp_avg"][rows].clone(),
                "exp_avg_sq": self.state["exp_avg_sq"][rows].clone(),
            }
        elif self.opt_cls is torch.optim.SGD and self.kw.get("momentum", 0):
            self.state.setdefault("momentum_buffer", torch.zeros_like(self.w))
            opt.state[q] = {"momentum_buffer": self.state["momentum_buffer"][rows].clone()}
        opt.step()
        self.steps += 1
        with torch.no_grad():
            self.w[rows] = q.detach()
            for k, v in opt.state[q].items():
                if k in self.state:
                    self.state[k][rows] = v
        self.ids = torch.empty(0, dtype=torch.long)


def table(m) -> torch.Tensor:
    return torch.from_numpy(np.array(m.weight.getNumpyVersion()))


def make(n=20, d=5, mode="mean", **kw):
    torch.manual_seed(0)
    return gl.OffloadedEmbeddingBag(n, d, mode, "cpu", device="cpu", **kw)


CASES = {
    # 2-D input, repeated ids within and across bags
    "2d": lambda dt: (torch.tensor([[1, 3, 3], [3, 7, 1], [0, 0, 0]], dtype=dt), None),
    # 1-D with offsets, an empty bag in the middle and at the end, repeats
    "1d": lambda dt: (
        torch.tensor([4, 4, 9, 2, 9, 9, 4], dtype=dt),
        torch.tensor([0, 2, 2, 5, 7], dtype=dt),
    ),
}


def _loss(out, k):
    g = torch.Generator().manual_seed(k)
    return (out * torch.randn(out.shape, generator=g)).sum() + (out**2).sum()


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dt", [torch.int64, torch.int32])
@pytest.mark.parametrize(
    "opt_cls,kw",
    [
        (torch.optim.Adam, {"lr": 0.05}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    ],
    ids=["adam", "sgd"],
)
def test_matches_torch_bag_over_steps(mode, case, dt, opt_cls, kw):
    m = make(mode=mode)
    ref = LazyRef(table(m), opt_cls, **kw)
    opt = gl.OffloadedOptimizer(opt_cls, m, **kw)
    inp, off = CASES[case](dt)
    batches = [(inp, off), (inp.flip(0) if off is None else inp, off)]
    for k in range(4):
        x, o = batches[k % 2]
        if k == 2:  # a step with other ids: lazy updates leave the others alone
            x = (x + 5) % 20
        out = m(x) if o is None else m(x, o)
        r = ref.forward(mode, x, o)
        assert out.dtype == torch.float32 and out.shape == r.shape
        torch.testing.assert_close(out, r, atol=ATOL, rtol=0)
        opt.zero_grad()
        _loss(out, k).backward()
        _loss(r, k).backward()
        opt.step()
        ref.step()
        torch.testing.assert_close(table(m), ref.w, atol=ATOL, rtol=1e-6)


@pytest.mark.parametrize("dt", [torch.int64, torch.int32])
def test_include_last_offset_and_per_sample_weights(dt):
    m = make(mode="sum", include_last_offset=True)
    ref = LazyRef(table(m), torch.optim.Adam, lr=0.03)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.03)
    x = torch.tensor([5, 5, 1, 19, 0, 5], dtype=dt)
    o = torch.tensor([0, 3, 3, 6], dtype=dt)  # 3 bags, the middle one empty
    for k in range(3):
        w = torch.linspace(-1.0, 2.0, 6) * (k + 1)
        out = m(x, o, per_sample_weights=w)
        r = ref.forward("sum", x, o, psw=w, include_last_offset=True)
        assert out.shape == (3, 5)
        torch.testing.assert_close(out, r, atol=ATOL, rtol=0)
        assert torch.all(out[1] == 0)
        opt.zero_grad()
        _loss(out, k).backward()
        _loss(r, k).backward()
        opt.step()
        ref.step()
        torch.testing.assert_close(table(m), ref.w, atol=ATOL, rtol=1e-6)


def test_per_sample_weights_gradient_flows():
    """torch's EmbeddingBag gives per_sample_weights a gradient in mode 'sum'."""
    m = make(mode="sum")
    x = torch.tensor([[1, 2], [3, 3]])
    w = torch.tensor([[0.5, 2.0], [1.0, -1.0]], requires_grad=True)
    m(x, per_sample_weights=w).sum().backward()
    ref_w = w.detach().clone().requires_grad_(True)
    # (a reference table that needs a gradient too: torch < 2.5 asserts when only the weights do)
    ref_t = table(m).requires_grad_()
    F.embedding_bag(x, ref_t, mode="sum", per_sample_weights=ref_w).sum().backward()
    assert w.grad is not None
    torch.testing.assert_close(w.grad, ref_w.grad, atol=ATOL, rtol=0)


@pytest.mark.parametrize("mode", ["mean", "max"])
def test_per_sample_weights_refused_outside_sum(mode):
    m = make(mode=mode)
    with pytest.raises(gl.GadgetError, match="sum"):
        m(torch.tensor([[1, 2]]), per_sample_weights=torch.ones(1, 2))


def test_unknown_mode_refused():
    with pytest.raises(gl.GadgetError, match="mode"):
        make(mode="prod")


def _bad_calls():
    one = torch.tensor([1, 2, 3, 4])
    return [
        ("unsorted", dict(input=one, offsets=torch.tensor([0, 3, 1]))),
        ("not from 0", dict(input=one, offsets=torch.tensor([1, 2]))),
        ("past the end", dict(input=one, offsets=torch.tensor([0, 5]))),
        ("negative", dict(input=one, offsets=torch.tensor([0, -1]))),
        ("float offsets", dict(input=one, offsets=torch.tensor([0.0, 2.0]))),
        ("2-D offsets", dict(input=one, offsets=torch.tensor([[0, 2]]))),
        ("no offsets", dict(input=one)),
        ("2-D with offsets", dict(input=one.view(2, 2), offsets=torch.tensor([0, 1]))),
        ("3-D input", dict(input=one.view(1, 2, 2))),
        (
            "psw wrong shape",
            dict(input=one, offsets=torch.tensor([0, 2]), per_sample_weights=torch.ones(3)),
        ),
        (
            "psw int",
            dict(
                input=one,
                offsets=torch.tensor([0, 2]),
                per_sample_weights=torch.ones(4, dtype=torch.int64),
            ),
        ),
        ("id out of range", dict(input=torch.tensor([1, 20]), offsets=torch.tensor([0]))),
        ("negative id", dict(input=torch.tensor([1, -1]), offsets=torch.tensor([0]))),
    ]


@pytest.mark.parametrize("name,call", _bad_calls(), ids=[n for n, _ in _bad_calls()])
def test_bad_call_is_clear_error_and_leaves_nothing(name, call):
    m = make(mode="sum")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.1)
    before = table(m).clone()
    with pytest.raises(gl.GadgetError):
        out = m(**call)
        out.sum().backward()
    opt.step()  # nothing recorded: nothing to step, no error
    assert torch.equal(table(m), before)
    # the next good step is the same as a first step (the bad call left no state)
    ref = LazyRef(before, torch.optim.Adam, lr=0.1)
    x = torch.tensor([[1, 2, 2]])
    out, r = m(x), ref.forward("sum", x)
    opt.zero_grad()
    out.sum().backward()
    r.sum().backward()
    opt.step()
    ref.step()
    torch.testing.assert_close(table(m), ref.w, atol=ATOL, rtol=1e-6)


def test_include_last_offset_must_end_at_length():
    m = make(mode="sum", include_last_offset=True)
    with pytest.raises(gl.GadgetError, match="end with 4"):
        m(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2]))


def test_empty_input_and_empty_bags():
    for mode in ("sum", "mean", "max"):
        m = make(mode=mode)
        out = m(torch.tensor([], dtype=torch.int64), torch.tensor([0, 0]))
        assert out.shape == (2, 5) and torch.all(out == 0)


def test_state_dict_round_trips_with_torch_embeddingbag():
    m = make(mode="mean")
    tb = torch.nn.EmbeddingBag(20, 5, mode="mean")
    tb.load_state_dict(m.state_dict())
    assert torch.equal(tb.weight.detach(), table(m))
    x = torch.tensor([[2, 4, 4], [0, 19, 3]])
    torch.testing.assert_close(m(x), tb(x), atol=ATOL, rtol=0)
    tb2 = torch.nn.EmbeddingBag(20, 5, mode="mean")
    m.load_state_dict(tb2.state_dict())
    assert torch.equal(table(m), tb2.weight.detach())
    with pytest.raises((gl.GadgetError, RuntimeError)):
        m.load_state_dict({"weight": torch.zeros(21, 5)})
    assert torch.equal(table(m), tb2.weight.detach())


def test_state_dict_restores_after_training():
    m = make(mode="sum")
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    opt = gl.OffloadedOptimizer(torch.optim.SGD, m, lr=0.5)
    m(torch.tensor([[1, 2]])).sum().backward()
    opt.step()
    assert not torch.equal(table(m), sd["weight"])
    m.load_state_dict(sd)
    assert torch.equal(table(m), sd["weight"])


def test_mixed_with_offloaded_embedding_in_one_optimizer_and_resume():
    torch.manual_seed(1)

    def build():
        torch.manual_seed(1)
        return torch.nn.ModuleDict(
            {
                "e": gl.OffloadedEmbedding(30, 4, "cpu", device="cpu"),
                "b": gl.OffloadedEmbeddingBag(25, 4, "sum", "cpu", device="cpu"),
                "h": torch.nn.Linear(4, 1),
            }
        )

    model = build()
    ref_e = LazyRef(table(model["e"]), torch.optim.Adam, lr=0.02)
    ref_b = LazyRef(table(model["b"]), torch.optim.Adam, lr=0.02)
    lin = torch.nn.Linear(4, 1)
    lin.load_state_dict(model["h"].state_dict())
    ref_lin_opt = torch.optim.Adam(lin.parameters(), lr=0.02)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, model, lr=0.02)
    batches = [
        (torch.tensor([1, 1, 29]), torch.tensor([[0, 3, 3], [24, 0, 1], [2, 2, 2]])),
        (torch.tensor([5, 1, 7]), torch.tensor([[9, 9, 8], [1, 2, 3], [4, 5, 6]])),
        (torch.tensor([0, 3, 3]), None),  # the bag has no lookup this step
    ]
    for items, hist in batches:
        y = torch.arange(3.0)
        e = model["e"](items)
        re_ = F.embedding(items, ref_e_p := torch.nn.Parameter(ref_e.w.clone()))
        ref_e.p, ref_e.ids = ref_e_p, items
        if hist is not None:
            z = e * model["b"](hist)
            rz = re_ * ref_b.forward("sum", hist)
        else:
            z, rz = e, re_
        loss = F.mse_loss(model["h"](z).squeeze(-1), y)
        rloss = F.mse_loss(lin(rz).squeeze(-1), y)
        torch.testing.assert_close(loss, rloss, atol=1e-6, rtol=1e-6)
        opt.zero_grad()
        ref_lin_opt.zero_grad()
        loss.backward()
        rloss.backward()
        opt.step()
        ref_lin_opt.step()
        ref_e.step()
        if hist is not None:
            ref_b.step()
        torch.testing.assert_close(table(model["e"]), ref_e.w, atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(table(model["b"]), ref_b.w, atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(model["h"].weight, lin.weight, atol=ATOL, rtol=1e-5)
    # resume: a fresh model and optimizer loading both state dicts continue identically
    model2 = build()
    model2.load_state_dict(model.state_dict())
    opt2 = gl.OffloadedOptimizer(torch.optim.Adam, model2, lr=0.02)
    opt2.load_state_dict(opt.state_dict())
    for mm, oo in ((model, opt), (model2, opt2)):
        out = (mm["e"](torch.tensor([1, 2])) * mm["b"](torch.tensor([[3, 4], [4, 4]]))).sum()
        oo.zero_grad()
        out.backward()
        oo.step()
    for k in ("e", "b"):
        assert torch.equal(table(model[k]), table(model2[k]))


def test_double_module_returns_double():
    m = make(mode="mean").double()
    out = m(torch.tensor([[1, 2]]))
    assert out.dtype == torch.float64


# --------------------------------------------------------------------------- word2vec


def _topic_corpus(path: Path, lines: int = 1500, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    topics = [[f"t{t}w{i}" for i in range(6)] for t in range(8)]
    text = [" ".join(rng.choice(topics[rng.integers(8)], size=8)) for _ in range(lines)]
    path.write_text("\n".join(text) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("w2vr")
    # upper-case words, one rare word (count 1)
    p = d / "c.txt"
    p.write_text(
        "The cat sat on the MAT\nthe dog sat on the log\nthe cat and THE dog\nzebra\n",
        encoding="utf-8",
    )
    return p


def _cli(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "datasets.word2vec", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_every_option_and_outputs(small, tmp_path, capsys):
    out = tmp_path / "vec"
    rc = word2vec.main(
        [
            str(small),
            "--dim",
            "6",
            "--epochs",
            "2",
            "--window",
            "2",
            "--negatives",
            "2",
            "--batch-size",
            "4",
            "--lr",
            "0.05",
            "--min-count",
            "2",
            "--placement",
            "cpu",
            "--device",
            "cpu",
            "--seed",
            "3",
            "--out",
            str(out),
            "--show",
            "CAT, nothere,,dog",
            "--no-progress",
        ]
    )
    o = capsys.readouterr()
    assert rc == 0, o.err
    vec = np.load(str(out) + ".npy")
    lines = (Path(str(out) + ".vocab.txt")).read_text(encoding="utf-8").splitlines()
    words = [ln.split()[0] for ln in lines]
    counts = [int(ln.split()[1]) for ln in lines]
    # min-count 2: 'zebra', 'mat', 'log', 'and' (count 1) dropped; lower-cased
    assert set(words) == {"the", "cat", "sat", "on", "dog"}
    assert words[0] == "the" and counts[0] == 6
    assert counts == sorted(counts, reverse=True)
    assert vec.shape == (5, 6) and vec.dtype == np.float32
    assert "vocabulary 5 words" in o.out and o.out.count("loss per epoch") == 1
    assert len(o.out.split("loss per epoch:")[1].splitlines()[0].split(",")) == 2
    assert "cat:" in o.out and "dog:" in o.out
    assert "nothere: not in the vocabulary" in o.out
    assert f"wrote {out}.npy and {out}.vocab.txt" in o.out
    # neighbours printed: 5 of the 4 others at most
    cat_line = next(ln for ln in o.out.splitlines() if ln.startswith("cat:"))
    assert cat_line.count("(") == 4


def test_same_seed_same_vectors_other_seed_differs(small, tmp_path, capsys):
    outs = []
    for seed, name in (("7", "a"), ("7", "b"), ("8", "c")):
        rc = word2vec.main(
            [
                str(small),
                "--dim",
                "4",
                "--placement",
                "cpu",
                "--device",
                "cpu",
                "--seed",
                seed,
                "--batch-size",
                "8",
                "--out",
                str(tmp_path / name),
                "--no-progress",
            ]
        )
        assert rc == 0
        outs.append(np.load(tmp_path / f"{name}.npy"))
    capsys.readouterr()
    assert np.array_equal(outs[0], outs[1])
    assert not np.array_equal(outs[0], outs[2])


BAD = [
    ["--dim", "0"],
    ["--dim", "x"],
    ["--dim", "2.5"],
    ["--epochs", "0"],
    ["--window", "0"],
    ["--negatives", "0"],
    ["--batch-size", "0"],
    ["--lr", "0"],
    ["--lr", "-1"],
    ["--lr", "inf"],
    ["--lr", "nan"],
    ["--lr", "abc"],
    ["--min-count", "0"],
    ["--seed", "-1"],
    ["--placement", "gpu"],
    ["--bogus", "1"],
]


@pytest.mark.parametrize("extra", BAD, ids=[" ".join(b) for b in BAD])
def test_bad_numbers_one_line(small, extra, capsys):
    with pytest.raises(SystemExit) as ei:
        word2vec.main([str(small), "--no-progress", *extra])
    err = capsys.readouterr().err
    assert ei.value.code == 2
    assert len(err.strip().splitlines()) == 1 and "error" in err


def test_out_errors_one_line(small, tmp_path, capsys):
    (tmp_path / "d").mkdir()
    (tmp_path / "x.npy").mkdir()
    for out in (tmp_path / "d", str(tmp_path / "d") + "/", tmp_path / "nope" / "v", tmp_path / "x"):
        with pytest.raises(SystemExit) as ei:
            word2vec.main([str(small), "--out", str(out), "--no-progress"])
        err = capsys.readouterr().err
        assert ei.value.code == 2 and len(err.strip().splitlines()) == 1, (out, err)
        assert "--out" in err


def test_cli_missing_empty_and_one_word_corpus(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    one = tmp_path / "one.txt"
    one.write_text("same same same\n", encoding="utf-8")
    cases = [tmp_path / "missing.txt", tmp_path, empty, one]
    for corpus in cases:
        r = _cli(corpus, "--placement", "cpu", "--device", "cpu", "--no-progress")
        assert r.returncode != 0, corpus
        assert "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert str(corpus) in r.stderr or "distinct word" in r.stderr


def test_cli_min_count_leaves_one_word(small):
    r = _cli(small, "--min-count", "5", "--placement", "cpu", "--device", "cpu", "--no-progress")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "distinct word" in r.stderr


def test_cli_bad_device_one_line(small):
    r = _cli(small, "--placement", "cpu", "--device", "bogus", "--no-progress")
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr[-600:]
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr[-600:]


def test_cli_cuda_placement_without_cuda_falls_back(small):
    """The library's documented fallback: placement 'cuda' without CUDA runs on the CPU
    with a FallbackWarning."""
    if torch.cuda.is_available():
        pytest.skip("machine has CUDA")
    r = _cli(small, "--placement", "cuda", "--dim", "4", "--no-progress")
    assert "Traceback" not in r.stderr, r.stderr[-600:]
    assert r.returncode == 0 and "vocabulary" in r.stdout, r.stderr[-600:]


def test_cli_default_pinned_on_cpu_machine_runs(small, tmp_path):
    """Module docstring: ``--placement pinned``; plain RAM on a machine without CUDA."""
    r = _cli(small, "--dim", "4", "--out", tmp_path / "v", "--no-progress")
    assert r.returncode == 0, r.stderr[-600:]
    assert (tmp_path / "v.npy").exists() and (tmp_path / "v.vocab.txt").exists()


def test_readme_example_and_planted_structure_one_epoch(tmp_path):
    """README: 'a small corpus (thousands of lines) ranks related words first after one
    epoch' with the default lr; the README's own command line (dim 128, 1 epoch)."""
    corpus = _topic_corpus(tmp_path / "corpus.txt", lines=3000)
    r = _cli(
        corpus,
        "--dim",
        "128",
        "--epochs",
        "1",
        "--out",
        tmp_path / "vectors",
        "--show",
        "t0w0,T3W2",
        "--no-progress",
        timeout=60,
    )
    assert r.returncode == 0, r.stderr[-600:]
    for w in ("t0w0", "t3w2"):
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith(w + ":"))
        near = [x.split()[0] for x in line.split(":", 1)[1].split(", ")]
        assert len(near) == 5
        assert all(n.split("w")[0] == w.split("w")[0] for n in near), line
    vec = np.load(tmp_path / "vectors.npy")
    assert vec.shape == (48, 128)


def _overcommit_always() -> bool:
    try:
        return Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1"
    except OSError:
        return False


@pytest.mark.skipif(
    _overcommit_always(),
    reason="vm.overcommit_memory=1: the OS grants any allocation and kills the process later "
    "instead of refusing it",
)
def test_cli_huge_dim_is_one_line_memory_error(small):
    r = _cli(
        small, "--dim", "100000000000", "--placement", "cpu", "--device", "cpu", "--no-progress"
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-600:]
    assert len(r.stderr.strip().splitlines()) == 1 and "not enough memory" in r.stderr
