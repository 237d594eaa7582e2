"""Session 35: arguments of the wrong kind get the library's own errors.

Each case once reached a raw Python / NumPy / torch error (or was silently taken as "not
given"): a tensor as ``dtype``, a list or array where a name belongs, nan / inf sizes,
huge counts, torch's own checks of optimizer options, bag inputs of the wrong kind.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

import gadgetloader as gl
from gadgetloader import (
    DataGadget,
    GadgetDataset,
    GadgetKeyError,
    GadgetLoader,
    GadgetSampler,
    GadgetTypeError,
    GadgetValueError,
    OffloadedEmbedding,
    OffloadedEmbeddingBag,
    OffloadedOptimizer,
)

pytestmark = pytest.mark.filterwarnings("ignore::gadgetloader.FallbackWarning")

NOT_NAMES = [["random"], ("a",), np.zeros(2), np.array(["sum"]), 3, 1.5, False, {"a": 1}]


def _ids(value):
    return type(value).__name__


# ---- dtype ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad",
    [torch.zeros(2), np.zeros(3), "make-a-gadget", False, {}, [1, 2], 7],
    ids=["tensor", "array", "gadget", "False", "dict", "list", "int"],
)
def test_dtype_of_the_wrong_kind_is_a_type_error(bad):
    if isinstance(bad, str) and bad == "make-a-gadget":
        bad = DataGadget((2, 2), placement="cpu")
    with pytest.raises(GadgetTypeError, match="dtype"):
        DataGadget((4, 3), dtype=bad, placement="cpu")


def test_a_tensor_as_dtype_says_to_pass_its_dtype():
    with pytest.raises(GadgetTypeError, match=r"\.dtype"):
        DataGadget((4, 3), dtype=torch.zeros(2, dtype=torch.float16), placement="cpu")
    # the dtypes users pass keep working
    for d, want in [
        (np.float32, torch.float32),
        (np.dtype("f2"), torch.float16),
        ("float64", torch.float64),
        (torch.int32, torch.int32),
        (float, torch.float64),
    ]:
        assert DataGadget((2, 3), dtype=d, placement="cpu").dtype == want


# ---- names ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", NOT_NAMES, ids=_ids)
def test_sampler_order_must_be_a_string(bad):
    with pytest.raises(GadgetTypeError, match="order must be a string"):
        GadgetSampler(10, batch_size=2, order=bad)


def test_sampler_unknown_order_is_a_key_error():
    with pytest.raises(GadgetKeyError, match="Unknown order 'shuffle'.*sequential"):
        GadgetSampler(10, batch_size=2, order="shuffle")


@pytest.mark.parametrize("bad", NOT_NAMES, ids=_ids)
def test_bag_mode_must_be_a_string(bad):
    with pytest.raises(GadgetTypeError, match="mode must be a string"):
        OffloadedEmbeddingBag(4, 3, mode=bad, placement="cpu")
    with pytest.raises(GadgetValueError, match="Unknown mode 'avg'"):
        OffloadedEmbeddingBag(4, 3, mode="avg", placement="cpu")


@pytest.mark.parametrize("bad", NOT_NAMES, ids=_ids)
def test_dataset_placement_must_be_a_string(bad):
    with pytest.raises(GadgetTypeError, match="placement must be a string"):
        GadgetDataset(np.zeros((4, 3), np.float32), placement=bad)


def test_dataset_unknown_placement_and_case():
    with pytest.raises(GadgetKeyError, match="Unknown placement 'disk'"):
        GadgetDataset(np.zeros((4, 3), np.float32), placement="disk")
    ds = GadgetDataset(np.ones((4, 3), np.float32), placement="CPU", device="cpu")
    assert ds.columns[0].placement == "cpu"


@pytest.mark.parametrize("bad", [["npy"], np.zeros(2), 3, False], ids=_ids)
def test_file_format_must_be_a_string(tmp_path, bad):
    path = tmp_path / "t.npy"
    np.save(path, np.arange(12, dtype=np.float32).reshape(4, 3))
    with pytest.raises(GadgetTypeError, match="format must be a string"):
        DataGadget(str(path), placement="file", format=bad)
    g = DataGadget(np.ones((2, 2), np.float32), placement="cpu")
    with pytest.raises(GadgetTypeError, match="format must be a string"):
        g.save(str(tmp_path / "out.npy"), format=bad)
    assert not (tmp_path / "out.npy").exists()
    assert sorted(os.listdir(tmp_path)) == ["t.npy"]


@pytest.mark.parametrize("bad", [["npy"], 0, False], ids=_ids)
def test_checkpoint_format_must_be_a_string(tmp_path, bad):
    emb = OffloadedEmbedding(4, 3, placement="cpu")
    with pytest.raises(GadgetTypeError, match="format must be a string"):
        gl.save_checkpoint(tmp_path / "ck", {"m": emb}, format=bad)


def test_variable_name_must_be_a_string():
    m = torch.nn.Module()
    m.emb = torch.nn.Embedding(10, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(GadgetTypeError, match="variable_name must be a string"):
        gl.OptimizerFactory(opt, 10, 4, m, ["emb"])


# ---- counts ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_sizes_are_value_errors(bad):
    with pytest.raises(GadgetValueError, match="num_embeddings must be a whole number"):
        OffloadedEmbedding(bad, 4, placement="cpu")
    with pytest.raises(GadgetValueError, match="embedding_dim must be a whole number"):
        OffloadedEmbeddingBag(4, bad, placement="cpu")
    m = torch.nn.Module()
    m.emb = torch.nn.Embedding(10, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(GadgetValueError, match="embed_dimension must be a whole number"):
        gl.OptimizerFactory(opt, 10, bad, m, "emb")


def test_optimizer_factory_embed_dimension_of_the_wrong_type():
    m = torch.nn.Module()
    m.emb = torch.nn.Embedding(10, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(GadgetTypeError, match="embed_dimension must be an integer"):
        gl.OptimizerFactory(opt, 10, [4], m, "emb")
    with pytest.raises(GadgetValueError, match="embed_dimension=5"):
        gl.OptimizerFactory(opt, 10, 5, m, "emb")
    assert gl.OptimizerFactory(opt, 10, 4.0, m, "emb").embed_dimension == 4


def test_sampler_row_count_beyond_int64():
    with pytest.raises(GadgetValueError, match="below 2\\*\\*63"):
        GadgetSampler(2**70, batch_size=4)
    assert len(GadgetSampler(2**40, batch_size=2**20)) == 2**20


def test_loader_huge_coalesce_means_the_whole_epoch():
    x = np.arange(40, dtype=np.float32).reshape(10, 4)
    ds = GadgetDataset(x, placement="cpu", device="cpu")
    batches = list(GadgetLoader(ds, batch_size=4, order="sequential", coalesce=2**70))
    assert [tuple(b[0].shape) for b in batches] == [(4, 4), (4, 4), (2, 4)]
    np.testing.assert_array_equal(torch.cat([b[0] for b in batches]).numpy(), x)


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (torch.zeros(2), GadgetTypeError),
        ("5", GadgetTypeError),
        (True, GadgetTypeError),
        (-1, GadgetValueError),
        (math.nan, GadgetValueError),
    ],
    ids=["tensor", "str", "bool", "negative", "nan"],
)
def test_loader_timeout(bad, error):
    ds = GadgetDataset(np.zeros((10, 4), np.float32), placement="cpu", device="cpu")
    with pytest.raises(error, match="timeout must be a number of seconds"):
        GadgetLoader(ds, batch_size=4, timeout=bad)
    assert len(GadgetLoader(ds, batch_size=4, timeout=2.5)) == 3


# ---- OffloadedOptimizer ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cls", "options", "error", "says"),
    [
        (torch.optim.SGD, {"lr": -1.0}, GadgetValueError, "Invalid learning rate"),
        (torch.optim.SGD, {"lr": 0.1, "momentum": -1.0}, GadgetValueError, "momentum"),
        (torch.optim.Adam, {"betas": 0.9}, GadgetTypeError, "betas"),
        (torch.optim.Adam, {"betas": (2.0, 0.9)}, GadgetValueError, "beta"),
        (torch.optim.Adam, {"eps": -1.0}, GadgetValueError, "epsilon"),
        (torch.optim.Adagrad, {"weight_decay": -1.0}, GadgetValueError, "weight_decay"),
        (torch.optim.Adam, {"lr": "fast"}, GadgetTypeError, "lr"),
        (torch.optim.Adam, {"no_such_option": 1}, GadgetTypeError, "no_such_option"),
    ],
)
def test_optimizer_options_torch_refuses_are_gadget_errors(cls, options, error, says):
    emb = OffloadedEmbedding(6, 3, placement="cpu")
    before = emb.weight.getData(range(6)).clone()
    with pytest.raises(error, match=says) as info:
        OffloadedOptimizer(cls, emb, **options)
    assert cls.__name__ in str(info.value)
    assert isinstance(info.value.__cause__, (TypeError, ValueError))
    # the table was not taken: a correct optimizer may have it
    torch.testing.assert_close(emb.weight.getData(range(6)), before)
    OffloadedOptimizer(cls, emb, lr=0.1)


def test_a_bare_tensor_as_params_is_refused_as_torch_does():
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(TypeError):
        torch.optim.SGD(p, lr=0.1)  # torch's own rule
    with pytest.raises(GadgetTypeError, match=r"pass \[tensor\]"):
        OffloadedOptimizer(torch.optim.SGD, p, lr=0.1)
    emb = OffloadedEmbedding(4, 3, placement="cpu")
    OffloadedOptimizer(torch.optim.SGD, [emb, p], lr=0.1)
    q = torch.zeros(3, requires_grad=True)
    opt = OffloadedOptimizer(torch.optim.SGD, [{"params": q}, emb], lr=0.1)  # a group may hold one
    assert any(x is q for g in opt.param_groups for x in g["params"])


@pytest.mark.parametrize("bad", [3, "loss", [1]], ids=_ids)
def test_step_closure_must_be_callable(bad):
    emb = OffloadedEmbedding(6, 3, placement="cpu")
    opt = OffloadedOptimizer(torch.optim.SGD, emb, lr=0.5)
    emb(torch.tensor([1, 2])).sum().backward()
    before = emb.weight.getData(range(6)).clone()
    with pytest.raises(GadgetTypeError, match="closure must be a callable"):
        opt.step(bad)
    torch.testing.assert_close(emb.weight.getData(range(6)), before)  # nothing stepped
    opt.step()
    changed = (emb.weight.getData(range(6)) != before).any(dim=1)
    assert changed.tolist() == [False, True, True, False, False, False]


# ---- EmbeddingBag inputs --------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["abc", 1.5, None, True], ids=_ids)
def test_bag_input_of_the_wrong_kind_is_a_type_error(bad):
    bag = OffloadedEmbeddingBag(10, 4, placement="cpu")
    with pytest.raises(GadgetTypeError, match="ids must be"):
        bag(bad)


def test_bag_ragged_input_is_a_type_error():
    bag = OffloadedEmbeddingBag(10, 4, placement="cpu")
    with pytest.raises(GadgetTypeError, match="rectangular"):
        bag([[1, 2], [3]])
    with pytest.raises(GadgetValueError, match="1-D .* or 2-D"):
        bag(3)  # 0-d: a shape error, as torch's


@pytest.mark.parametrize("bad", ["ab", b"ab", {"a": 1}, object()], ids=_ids)
def test_bag_offsets_of_the_wrong_kind_are_type_errors(bad):
    bag = OffloadedEmbeddingBag(10, 4, placement="cpu")
    with pytest.raises(GadgetTypeError, match="offsets must be a 1-D"):
        bag(torch.tensor([1, 2, 3]), bad)


def test_bag_offsets_as_list_or_array_match_a_tensor():
    bag = OffloadedEmbeddingBag(10, 4, mode="sum", placement="cpu")
    ids = torch.tensor([1, 2, 3])
    want = bag(ids, torch.tensor([0, 1]))
    torch.testing.assert_close(bag(ids, [0, 1]), want)
    torch.testing.assert_close(bag(ids, np.array([0, 1])), want)
    rows = bag.weight.getData(range(10))
    torch.testing.assert_close(want, torch.stack([rows[1], rows[2] + rows[3]]))


# ---- zarr replacement: a `.old-` entry is always a complete store ------------------------------
def test_zarr_save_removes_the_old_store_under_a_trash_name(tmp_path, monkeypatch):
    pytest.importorskip("zarr")
    from gadgetloader.io import _atomic

    target = tmp_path / "t.zarr"
    DataGadget(np.zeros((6, 3), np.float32), placement="cpu").save(str(target))
    removed = []

    def keep(path):  # a kill during the removal: the entry stays as it was renamed
        removed.append(os.path.basename(path))

    monkeypatch.setattr(_atomic, "remove_path", keep)
    new = np.arange(18, dtype=np.float32).reshape(6, 3)
    # (the entry left is named in a warning: see test_session46_fixes)
    with pytest.warns(UserWarning, match=r"could not all be removed; remove .*\.t\.zarr\.trash-"):
        DataGadget(new, placement="cpu").save(str(target))
    assert len(removed) == 1 and removed[0].startswith(".t.zarr.trash-"), removed
    names = os.listdir(tmp_path)
    assert not [n for n in names if ".old-" in n], names
    got = DataGadget(str(target), placement="cpu", device="cpu").getData(range(6))
    np.testing.assert_array_equal(got.numpy(), new)
    # the half-deleted entry is the old store (here intact), beside the new one
    old = DataGadget(str(tmp_path / removed[0]), placement="cpu", device="cpu", format="zarr")
    np.testing.assert_array_equal(old.getData(range(6)).numpy(), np.zeros((6, 3), np.float32))


def test_checkpoint_meta_temporary_is_hidden(tmp_path, monkeypatch):
    emb = OffloadedEmbedding(5, 3, placement="cpu", device="cpu")
    written = []
    real = torch.save

    def save(obj, f, *a, **k):  # a kill just after the temporary was written
        real(obj, f, *a, **k)
        if isinstance(f, (str, os.PathLike)):
            written.append(os.path.basename(f))
            raise SystemExit("killed")

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(SystemExit):
        gl.save_checkpoint(tmp_path / "ck", {"m": emb}, format="npy")
    assert written == [".meta.pt.tmp"]
    monkeypatch.setattr(torch, "save", real)
    gl.save_checkpoint(tmp_path / "ck", {"m": emb}, format="npy")
    names = os.listdir(tmp_path / "ck")
    assert "meta.pt" in names and not [n for n in names if n.endswith(".tmp")], names
    fresh = OffloadedEmbedding(5, 3, placement="cpu", device="cpu")
    gl.load_checkpoint(tmp_path / "ck", {"m": fresh})
    torch.testing.assert_close(fresh.weight.getData(range(5)), emb.weight.getData(range(5)))


@pytest.mark.parametrize("key", ["src_format", "dst_format"])
@pytest.mark.parametrize("bad", [False, ["npy"], 0], ids=_ids)
def test_convert_format_must_be_a_string(tmp_path, key, bad):
    from gadgetloader.convert import convert

    np.save(tmp_path / "a.npy", np.ones((3, 2), np.float32))
    with pytest.raises(GadgetTypeError, match="format must be a string"):
        convert(str(tmp_path / "a.npy"), str(tmp_path / "b.npy"), **{key: bad})
    assert os.listdir(tmp_path) == ["a.npy"]
    convert(str(tmp_path / "a.npy"), str(tmp_path / "b.npy"), **{key: "npy"})
    np.testing.assert_array_equal(np.load(tmp_path / "b.npy"), np.ones((3, 2), np.float32))


# ---- fork: other threads' registered per-thread buffers are not freed in the child -----------
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_registered_thread_local_values_survive_a_fork(tmp_path):
    """In a forked child Python clears every other thread's state (freeing its
    threading.local values) before any at-fork hook runs; a registered value (in the
    library: a thread's page-locked buffers, whose destructor calls CUDA) must not die."""
    import threading

    from gadgetloader._fork import keep_in_forked_child

    log = tmp_path / "freed"

    class Buffer:
        def __init__(self, kept: bool) -> None:
            self.kept = kept

        def __del__(self) -> None:
            with open(log, "a") as f:
                f.write(f"{os.getpid()} {self.kept}\n")

    local = threading.local()
    ready, done = threading.Event(), threading.Event()

    def worker() -> None:
        local.kept = keep_in_forked_child(Buffer(True))
        local.plain = Buffer(False)
        ready.set()
        done.wait(30)
        del local.kept, local.plain

    t = threading.Thread(target=worker)
    t.start()
    try:
        assert ready.wait(30)
        pid = os.fork()
        if pid == 0:  # the child: only this thread is left
            import gc

            gc.collect()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        done.set()
        t.join(30)
    lines = log.read_text().split("\n") if log.exists() else []
    in_child = [line for line in lines if line.startswith(f"{pid} ")]
    # the unregistered value died in the child (the hazard), the registered one did not
    assert in_child == [f"{pid} False"], lines
