"""word2vec skip-gram with negative sampling, tables and Adam state off the GPU.

Both embedding tables (input ``u`` and output ``v``) and their Adam moments live in
pinned host RAM by default (``--placement pinned``; plain RAM, silently, on a machine
without CUDA, where asking for ``pinned`` by name warns and falls back); each
step pages only the batch's distinct rows to the GPU and back, so the vocabulary
can be far larger than GPU memory. The training loop is plain PyTorch:
forward, backward, ``optimizer.step()``.

Usage::

    python -m datasets.word2vec corpus.txt --dim 128 --epochs 1 --out vectors

writes ``vectors.npy`` (the input embeddings, one row per word) and
``vectors.vocab.txt`` (the words in row order, with counts). Bad arguments (a missing
corpus and an unusable ``--out`` too) exit with status 2; a corpus too small to train on,
training that diverged, sizes beyond memory or a failed save with status 1; each with a
one-line message.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 (the torch idiom)
from torch import nn
from tqdm.auto import tqdm

import gadgetloader as gl
from gadgetloader.bench._common import MAX_LEARNING_RATE, learning_rate

__all__ = ["SkipGram", "Vocab", "Word2VecResult", "build_vocab", "main", "skipgram_pairs", "train"]


@dataclass
class Vocab:
    """Words by id (most frequent first) and their counts."""

    words: list[str]
    counts: np.ndarray
    index: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.index:
            self.index = {w: i for i, w in enumerate(self.words)}

    def __len__(self) -> int:
        return len(self.words)


def _tokens(path: str | os.PathLike[str]) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            yield from line.lower().split()


def build_vocab(path: str | os.PathLike[str], min_count: int = 1) -> tuple[Vocab, np.ndarray]:
    """Read a whitespace-tokenised text file: the vocabulary and the corpus as word ids
    (words rarer than ``min_count`` dropped)."""
    counts = collections.Counter(_tokens(path))
    kept = [(w, c) for w, c in counts.most_common() if c >= min_count]
    if len(kept) < 2:
        raise ValueError(
            f"{os.fspath(path)}: {len(kept)} distinct word(s) occur at least {min_count} times; "
            "skip-gram needs at least 2 (a word and others to tell it from)"
        )
    vocab = Vocab([w for w, _ in kept], np.array([c for _, c in kept], dtype=np.int64))
    ids = np.fromiter((vocab.index.get(t, -1) for t in _tokens(path)), dtype=np.int64)
    return vocab, ids[ids >= 0]


def skipgram_pairs(
    ids: np.ndarray,
    window: int,
    rng: np.random.Generator,
    centers_in: tuple[int, int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(center, context) pairs with word2vec's dynamic window (each center draws a
    window size in ``1..window``), vectorised over the corpus.

    ``centers_in=(lo, hi)`` keeps the pairs whose center lies at positions ``lo..hi-1``
    (their contexts may lie outside): chunks of a corpus that overlap by ``window``
    tokens then give every pair of the corpus exactly once."""
    n = ids.shape[0]
    lo, hi = centers_in if centers_in is not None else (0, n)
    pos = np.arange(n)
    reach = rng.integers(1, window + 1, size=n)
    centers, contexts = [], []
    for d in range(1, window + 1):
        if d >= n:
            break
        # center i, context i + d
        ok_fwd = (reach[: n - d] >= d) & (pos[: n - d] >= lo) & (pos[: n - d] < hi)
        centers.append(ids[: n - d][ok_fwd])
        contexts.append(ids[d:][ok_fwd])
        # center i, context i - d
        ok_bwd = (reach[d:] >= d) & (pos[d:] >= lo) & (pos[d:] < hi)
        centers.append(ids[d:][ok_bwd])
        contexts.append(ids[: n - d][ok_bwd])
    if not centers:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    return np.concatenate(centers), np.concatenate(contexts)


class SkipGram(nn.Module):
    """Input and output embeddings in stores; SGNS loss."""

    def __init__(
        self, vocab_size: int, dim: int, placement: str | None, device: Any, seed: int
    ) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        bound = 0.5 / dim

        def init_u(t: torch.Tensor) -> None:
            for start in range(0, t.shape[0], 1 << 16):
                blk = torch.empty(min(1 << 16, t.shape[0] - start), dim).uniform_(
                    -bound, bound, generator=gen
                )
                t[start : start + blk.shape[0]].copy_(blk.to(t.device, t.dtype))

        self.u = gl.OffloadedEmbedding(vocab_size, dim, placement, device=device, init=init_u)
        self.v = gl.OffloadedEmbedding(
            vocab_size, dim, placement, device=device, init=torch.nn.init.zeros_
        )

    def forward(
        self, center: torch.Tensor, context: torch.Tensor, negatives: torch.Tensor
    ) -> torch.Tensor:
        u = self.u(center)  # (B, dim)
        pos = (u * self.v(context)).sum(-1)
        neg = torch.bmm(self.v(negatives), u.unsqueeze(2)).squeeze(2)  # (B, k)
        return -(F.logsigmoid(pos).sum() + F.logsigmoid(-neg).sum()) / center.shape[0]


@dataclass
class Word2VecResult:
    """A trained model: the vocabulary, the model (tables in stores), the loss per epoch."""

    vocab: Vocab
    model: SkipGram
    losses: list[float]

    def vectors(self) -> np.ndarray:
        """The input embeddings as a NumPy array (one row per word)."""
        return self.model.u.table.getNumpyVersion()

    def most_similar(self, word: str, k: int = 10) -> list[tuple[str, float]]:
        """The ``k`` words with the highest cosine similarity to ``word`` (lower-cased, as
        the corpus is), best first; a word not in the vocabulary is a ``KeyError``."""
        word = word.lower()
        if word not in self.vocab.index:
            raise KeyError(f"{word!r} is not in the vocabulary ({len(self.vocab)} words)")
        vec = self.vectors()
        unit = vec / np.maximum(np.linalg.norm(vec, axis=1, keepdims=True), 1e-12)
        sims = unit @ unit[self.vocab.index[word]]
        order = [i for i in np.argsort(-sims) if self.vocab.words[i] != word][:k]
        return [(self.vocab.words[i], float(sims[i])) for i in order]

    def save(self, prefix: str | os.PathLike[str]) -> None:
        """``prefix.npy`` (vectors) and ``prefix.vocab.txt`` (word and count per line).

        Both are written beside their paths first and renamed into place, the word list
        last: a failed save leaves the files that were there before (a failure of that
        last rename alone, which is rare, leaves new vectors beside the old word list,
        and the error says so)."""
        from gadgetloader.io._atomic import remove_path, replace_atomically, temp_path_beside

        prefix = os.fspath(prefix)
        vocab_path = prefix + ".vocab.txt"
        for target in (prefix + ".npy", vocab_path):
            if os.path.exists(target) and not os.path.isfile(target):
                raise gl.GadgetFileError(
                    f"{target} is not a regular file, and a save replaces what is at its path"
                )
        tmp = temp_path_beside(vocab_path)
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                for w, c in zip(self.vocab.words, self.vocab.counts, strict=False):
                    f.write(f"{w} {c}\n")
                f.flush()
                os.fsync(f.fileno())
            self.model.u.table.save(prefix + ".npy")
            try:
                replace_atomically(tmp, vocab_path)
            except OSError as exc:
                raise OSError(
                    f"{prefix}.npy was written, but {vocab_path} could not be replaced "
                    f"({exc}); the word list there is not this run's"
                ) from exc
        finally:
            if os.path.lexists(tmp):
                remove_path(tmp)


def train(
    corpus: str | os.PathLike[str],
    *,
    dim: int = 100,
    epochs: int = 1,
    window: int = 5,
    negatives: int = 5,
    batch_size: int = 4096,
    lr: float = 0.01,
    min_count: int = 1,
    placement: str | None = None,
    device: Any = None,
    seed: int = 0,
    chunk_tokens: int = 1 << 20,
    progress: bool | None = None,
) -> Word2VecResult:
    """Train skip-gram with negative sampling on a text file.

    Parameters
    ----------
    corpus : path
        Any text file, read as UTF-8 (undecodable bytes become U+FFFD); words are the
        lower-cased whitespace-separated tokens.
    dim, epochs, window, negatives, batch_size, lr, min_count
        The usual word2vec settings (``negatives`` drawn from unigram counts ** 0.75;
        ``batch_size`` counts (center, context) pairs).
    placement : {'pinned', 'cpu', 'cuda'}, optional
        Where both tables and their Adam state live (default: ``pinned`` with CUDA,
        else ``cpu``, as :class:`gadgetloader.OffloadedEmbedding`).
    device : optional
        Where the steps run (default: the GPU where present).
    chunk_tokens : int
        Pairs are built and shuffled per chunk of this many tokens, so memory stays
        bounded for large corpora.
    progress : bool, optional
        tqdm progress bar (default: when stderr is a terminal).

    Notes
    -----
    Each step moves only the distinct rows of the batch (and their two Adam moments)
    between the stores and the GPU; repeated words within a batch are merged, so their
    gradients add up exactly. The output table starts at zero (as in word2vec), so the
    first step moves only it: a corpus that fits in one batch wants several ``epochs``.

    Raises
    ------
    ValueError
        Bad settings (whole numbers below 1 -- ``seed`` below 0 -- or not whole numbers,
        ``negatives`` above 2**20, ``lr`` not above 0 or above 1e30), a corpus with fewer
        than two distinct words, or training that diverged (an epoch's loss, or a value
        of the vectors an epoch leaves, is not finite: ``lr`` is too large).
    MemoryError
        Before training, where the (center, context) pairs of one chunk of
        ``chunk_tokens`` tokens (about ``window + 1`` per token) would not fit in RAM.
    """
    dim, epochs, window, negatives, batch_size, min_count, seed, chunk_tokens = _check_settings(
        dim=dim,
        epochs=epochs,
        window=window,
        negatives=negatives,
        batch_size=batch_size,
        min_count=min_count,
        seed=seed,
        chunk_tokens=chunk_tokens,
    )
    try:
        rate = float(lr) if not isinstance(lr, (bool, str)) else None
    except (TypeError, ValueError, RuntimeError):  # (a tensor of several values: RuntimeError)
        rate = None
    if rate is None or not 0 < rate <= MAX_LEARNING_RATE:  # (nan fails this too)
        raise ValueError(
            f"lr must be a number above 0 and at most {MAX_LEARNING_RATE:g} (float32 Adam "
            f"steps overflow beyond); got {lr!r}"
        )
    lr = rate
    vocab, ids = build_vocab(corpus, min_count)
    _check_pair_memory(ids.shape[0], window, chunk_tokens)
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    model = SkipGram(len(vocab), dim, placement, device, seed)
    dev = model.u.compute_device
    opt = gl.OffloadedOptimizer(torch.optim.Adam, model, lr=lr)
    noise = torch.from_numpy(vocab.counts.astype(np.float64) ** 0.75).to(dev)
    noise_gen = torch.Generator(device=dev).manual_seed(seed)
    show = sys.stderr.isatty() if progress is None else progress
    losses: list[float] = []
    approx_pairs = int(ids.shape[0] * (window + 1))  # mean dynamic window (w+1)/2, both sides
    for epoch in range(epochs):
        total, steps = torch.zeros((), device=dev), 0
        bar = tqdm(
            total=approx_pairs,
            disable=not show,
            desc=f"epoch {epoch + 1}/{epochs}",
            unit="pair",
            unit_scale=True,
        )
        for start in range(0, ids.shape[0], chunk_tokens):
            # the chunk's centers, with `window` tokens of context on each side
            first = max(0, start - window)
            chunk = ids[first : start + chunk_tokens + window]
            core = (start - first, start - first + min(chunk_tokens, ids.shape[0] - start))
            c, x = skipgram_pairs(chunk, window, rng, centers_in=core)
            # the bar's total: the pairs made so far plus an estimate for the tokens left,
            # exact once the last chunk's pairs are made (so the bar ends at 100%)
            left = ids.shape[0] - (start + core[1] - core[0])
            bar.total = bar.n + c.shape[0] + left * (window + 1)
            bar.refresh()
            perm = rng.permutation(c.shape[0])
            c_t = torch.from_numpy(c[perm]).to(dev)
            x_t = torch.from_numpy(x[perm]).to(dev)
            for b in range(0, c_t.shape[0], batch_size):
                center, context = c_t[b : b + batch_size], x_t[b : b + batch_size]
                neg = torch.multinomial(
                    noise, center.shape[0] * negatives, replacement=True, generator=noise_gen
                )
                opt.zero_grad()
                loss = model(center, context, neg.view(-1, negatives))
                loss.backward()
                opt.step()
                total += loss.detach()
                steps += 1
                bar.update(center.shape[0])
        bar.close()
        losses.append(float(total) / max(steps, 1))
        if not np.isfinite(losses[-1]):
            raise ValueError(
                f"training diverged: the loss of epoch {len(losses)} is {losses[-1]} "
                f"(lr {lr}); lower the learning rate"
            )
        # an epoch's loss is measured before each of its steps: its last step may still
        # have left values that are not finite (a corpus of one batch shows nothing else)
        for name, emb in (("input", model.u), ("output", model.v)):
            if not _all_finite(emb.table):
                raise ValueError(
                    f"training diverged: epoch {len(losses)} left values that are not finite "
                    f"in the {name} vectors (lr {lr}); lower the learning rate"
                )
    return Word2VecResult(vocab, model, losses)


#: the whole-number settings of :func:`train` and the command line: (least, most)
_LIMITS: dict[str, tuple[int, int]] = {
    "dim": (1, 2**63 - 1),
    "epochs": (1, 2**63 - 1),
    "window": (1, 2**63 - 1),
    "negatives": (1, 1 << 20),
    "batch_size": (1, 2**63 - 1),
    "min_count": (1, 2**63 - 1),
    "seed": (0, 2**63 - 1),
    "chunk_tokens": (1, 2**63 - 1),
}


def _check_settings(**settings: Any) -> list[int]:
    """The whole-number settings of :func:`train` as Python ints, in the order given
    (NumPy integers too); ``ValueError`` for one that is not whole or is outside
    :data:`_LIMITS`."""
    out = []
    for name, value in settings.items():
        low, high = _LIMITS[name]
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name} must be a whole number; got {value!r}")
        if not low <= value <= high:
            top = "" if high == 2**63 - 1 else f" and at most {high}"
            raise ValueError(f"{name} must be at least {low}{top}; got {value}")
        out.append(int(value))
    return out


#: bytes of host memory one (center, context) pair of a chunk takes at its peak (the two
#: int64 columns, the per-distance pieces they are joined from, their shuffled copies)
_PAIR_BYTES = 48


def _check_pair_memory(tokens: int, window: int, chunk_tokens: int) -> None:
    """``MemoryError`` where the pairs of one chunk (about ``window + 1`` per center, at
    most one per other token of the corpus) would not fit in this machine's RAM."""
    from gadgetloader._errors import host_memory_bytes

    ram = host_memory_bytes(swap=False)
    centers = min(tokens, chunk_tokens)
    pairs = centers * min(window + 1, max(tokens - 1, 0))
    need = pairs * _PAIR_BYTES
    if ram is not None and need > ram:
        raise MemoryError(
            f"window {window} makes about {pairs:,} (center, context) pairs per chunk of "
            f"{centers:,} tokens, about {need / 1e9:.1f} GB, more than this machine's "
            f"{ram / 1e9:.1f} GB of RAM; lower the window"
        )


def _all_finite(table: gl.DataGadget) -> bool:
    """Whether every value of ``table`` is finite (read about 64 MiB at a time)."""
    row_bytes = max(1, table.nbytes // max(1, len(table)))
    step = max(1, (64 << 20) // row_bytes)
    for start in range(0, len(table), step):
        if not bool(torch.isfinite(table[start : start + step]).all()):
            return False
    return True


def _count(name: str) -> Any:
    """An argparse type for the whole-number setting ``name`` (its :data:`_LIMITS`)."""
    low, high = _LIMITS[name]

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"expected a number of at least {low} and at most {high}, got {value}"
            )
        return value

    return parse


def _device(text: str) -> str:
    """An argparse type: ``cuda``, ``cuda:N`` or ``cpu`` (checked before any training)."""
    try:
        kind = torch.device(text).type
    except RuntimeError:
        kind = None
    if kind not in ("cuda", "cpu"):
        raise argparse.ArgumentTypeError(f"expected 'cuda', 'cuda:N' or 'cpu', got {text!r}")
    return text


class _OneLineErrors(argparse.ArgumentParser):
    """Errors are one line (``--help`` shows the usage), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    p = _OneLineErrors(prog="python -m datasets.word2vec", description=__doc__.split("\n\n")[0])
    p.add_argument("corpus", help="a text file")
    p.add_argument("--dim", type=_count("dim"), default=100, help="vector width (default 100)")
    p.add_argument("--epochs", type=_count("epochs"), default=1, help="passes (default 1)")
    p.add_argument(
        "--window", type=_count("window"), default=5, help="context words each side (default 5)"
    )
    p.add_argument(
        "--negatives",
        type=_count("negatives"),
        default=5,
        help="negative samples per pair (default 5)",
    )
    p.add_argument(
        "--batch-size",
        type=_count("batch_size"),
        default=4096,
        help="(center, context) pairs per step (default 4096)",
    )
    p.add_argument(
        "--lr",
        type=learning_rate,
        default=0.01,
        help="Adam's learning rate (default 0.01; small corpora want several --epochs)",
    )
    p.add_argument(
        "--min-count",
        type=_count("min_count"),
        default=1,
        help="drop words seen fewer times (default 1)",
    )
    p.add_argument(
        "--placement",
        default=None,
        choices=["pinned", "cpu", "cuda"],
        help="where the tables and Adam state live (default: pinned with CUDA, else cpu)",
    )
    p.add_argument(
        "--device", type=_device, default=None, help="where the model computes: cuda, cuda:N or cpu"
    )
    p.add_argument("--seed", type=_count("seed"), default=0, help="(default 0)")
    p.add_argument("--out", default=None, help="write OUT.npy and OUT.vocab.txt")
    p.add_argument(
        "--show", default=None, help="comma-separated words: print their nearest neighbours"
    )
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    # user errors found before training: one line each, not a traceback after the work
    if not os.path.isfile(args.corpus):
        p.error(
            f"{args.corpus}: no such file"
            if not os.path.exists(args.corpus)
            else f"{args.corpus}: not a file"
        )
    if args.out is not None:
        if not os.path.basename(args.out) or os.path.isdir(args.out):
            p.error(f"--out {args.out}: expected a file name prefix (OUT.npy, OUT.vocab.txt)")
        folder = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            p.error(f"--out {args.out}: {folder} is not a writable directory")
        for target in (args.out + ".npy", args.out + ".vocab.txt"):
            if os.path.isdir(target):
                p.error(f"--out {args.out}: {target} is a directory")
            if os.path.exists(target) and not os.path.isfile(target):
                p.error(
                    f"--out {args.out}: {target} is not a regular file (a device, pipe or "
                    "socket), and a save replaces what is at its path"
                )
            # a symbolic link is written through: its target's folder must exist
            real = os.path.dirname(os.path.realpath(target))
            if not os.path.isdir(real) or not os.access(real, os.W_OK):
                p.error(f"--out {args.out}: {target} leads to {real}, not a writable directory")
            if os.path.exists(target) and not os.access(target, os.W_OK):
                p.error(f"--out {args.out}: {target} is not writable")
    try:
        result = train(
            args.corpus,
            dim=args.dim,
            epochs=args.epochs,
            window=args.window,
            negatives=args.negatives,
            batch_size=args.batch_size,
            lr=args.lr,
            min_count=args.min_count,
            placement=args.placement,
            device=args.device,
            seed=args.seed,
            progress=False if args.no_progress else None,
        )
    except (MemoryError, ValueError, OSError, RuntimeError, gl.GadgetError) as exc:
        text = str(exc)
        memory = isinstance(exc, MemoryError) or (
            isinstance(exc, RuntimeError) and ("alloc" in text or "out of memory" in text)
        )
        if not memory:
            if isinstance(exc, (ValueError, OSError, gl.GadgetError)):
                print(f"{p.prog}: error: {exc}", file=sys.stderr)
                return 1
            raise
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        if first.startswith("window "):  # (the pairs' estimate, before any training)
            print(f"{p.prog}: error: --{first}", file=sys.stderr)
            return 1
        print(
            f"{p.prog}: error: not enough memory for tables of these sizes "
            f"(--dim {args.dim}, --window {args.window}, --negatives {args.negatives}, "
            f"--batch-size {args.batch_size}): {first}",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print(f"{p.prog}: interrupted; nothing was written", file=sys.stderr)
        return 130
    print(
        f"vocabulary {len(result.vocab)} words; loss per epoch: "
        + ", ".join(f"{x:.4f}" for x in result.losses)
    )
    if args.show:
        for w in (t.strip().lower() for t in args.show.split(",")):
            if not w:
                continue
            if w in result.vocab.index:
                near = ", ".join(f"{n} ({s:.2f})" for n, s in result.most_similar(w, 5))
                print(f"{w}: {near}")
            else:
                print(f"{w}: not in the vocabulary")
    if args.out:
        try:
            result.save(args.out)
        except (OSError, gl.GadgetError) as exc:
            print(f"{p.prog}: error: saving {args.out}: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(f"{p.prog}: interrupted while saving {args.out}", file=sys.stderr)
            return 130
        print(f"wrote {args.out}.npy and {args.out}.vocab.txt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
