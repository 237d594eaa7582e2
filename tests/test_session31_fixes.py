"""Session 31's fixes:

* ``--lr`` of ``gadgetloader bench train`` and of the word2vec example refuses a learning
  rate above 1e30 (Adam's first float32 step, ten times ``lr``, overflows a little above
  3e37 and used to end in a traceback) with a one-line error naming ``--lr``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gadgetloader.bench._common import MAX_LEARNING_RATE, learning_rate

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text", ["1e-3", "0.5", "10", "1e30"])
def test_learning_rate_takes_rates_up_to_the_cap(text: str) -> None:
    assert learning_rate(text) == float(text)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("1e31", "at most 1e30"),
        ("1e38", "at most 1e30"),
        ("0", "above 0"),
        ("-1", "above 0"),
        ("inf", "finite"),
        ("nan", "finite"),
        ("x", "expected a number"),
    ],
)
def test_learning_rate_refuses_with_the_value(text: str, fragment: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=fragment) as info:
        learning_rate(text)
    assert text in str(info.value)


def test_the_cap_is_below_the_float32_overflow_of_adams_first_step() -> None:
    import numpy as np

    # Adam's first step divides lr by 1 - beta1 = 0.1: the cap's step stays finite
    assert np.isfinite(np.float32(MAX_LEARNING_RATE / 0.1))


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "args",
    [
        ["-m", "gadgetloader", "bench", "train", "--lr", "1e38"],
        ["-m", "datasets.word2vec", "CORPUS", "--lr", "1e38"],
    ],
    ids=["bench-train", "word2vec"],
)
def test_a_learning_rate_that_overflows_is_a_one_line_error(args: list[str], tmp_path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat\nthe dog sat\n")
    p = _run([str(corpus) if a == "CORPUS" else a for a in args])
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert "Traceback" not in p.stderr
    assert "--lr" in lines[-1] and "at most 1e30" in lines[-1] and "1e38" in lines[-1]
