"""The ``gadgetloader`` command: ``info``, ``bench`` (and its suites), ``convert``."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]

#: bench suites: name -> (module, help); each module has add_arguments(parser) and run(args) -> dict
_SUITES: dict[str, tuple[str, str]] = {
    "seed": ("gadgetloader.bench._seed", "gather/scatter of random rows (the default)"),
    "sweep": ("gadgetloader.bench._sweep", "gather/scatter over table sizes and row widths"),
    "files": ("gadgetloader.bench._files", "loading and random reads from .npy / HDF5 / zarr"),
    "pipeline": (
        "gadgetloader.bench._pipeline",
        "DataLoader batches: torch per-sample vs gadgetloader",
    ),
    "train": ("gadgetloader.bench._train", "embedding training steps with offloaded tables"),
}


def _available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _parser() -> argparse.ArgumentParser:
    return _parsers()[0]


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command line's parser, and each command's own (``"bench sweep"``, ...) by name:
    a command's usage errors name it (``gadgetloader bench sweep: error: ...``)."""
    p = argparse.ArgumentParser(
        prog="gadgetloader", description="PyTorch tables too big for the GPU."
    )
    from . import __version__

    p.add_argument("--version", action="version", version=f"gadgetloader {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser(
        "info", help="versions, GPU and measured link bandwidth (for bug reports)"
    )
    info.add_argument("--no-measure", action="store_true", help="skip the bandwidth measurement")
    info.add_argument("--json", metavar="FILE", help="also write the information as JSON")
    commands = {"info": info}

    bench = sub.add_parser(
        "bench",
        help="benchmarks against the baselines, in one run",
        usage="%(prog)s [-h] [SUITE] [options of that suite, after its name]",
        description="Without SUITE the seed benchmark runs (its options then follow "
        "'bench' directly). `gadgetloader bench SUITE -h` lists a suite's options.",
    )
    commands["bench"] = bench
    bench.add_argument("--json", metavar="FILE", help="write the results as JSON")
    suites = bench.add_subparsers(dest="suite", required=False, metavar="SUITE")
    importlib.import_module(_SUITES["seed"][0]).add_arguments(bench)  # `bench --rows N` = seed
    for name, (module, help_text) in _SUITES.items():
        if not _available(module):
            continue
        sp = suites.add_parser(name, help=help_text, prog=f"{p.prog} bench {name}")
        sp.add_argument("--json", metavar="FILE", help="write the results as JSON")
        commands[f"bench {name}"] = sp
        importlib.import_module(module).add_arguments(sp)

    if _available("gadgetloader.convert"):
        conv = sub.add_parser(
            "convert", help="convert a table between .npy, HDF5 and zarr (streaming)"
        )
        importlib.import_module("gadgetloader.convert").add_arguments(conv)
        commands["convert"] = conv
    return p, commands


def _write_json(path: str | None, data: Any, command: str) -> int:
    """Write ``data`` to ``path`` (if given); the exit status (1: it could not be written,
    said in one line)."""
    if path:
        from .io._atomic import remove_path, replace_atomically, temp_path_beside

        # written beside and renamed: a write that fails part-way (a full disk) leaves the
        # previous file, never a truncated one
        tmp = temp_path_beside(path)
        try:
            with open(tmp, "w") as f:
                json.dump(data, f, indent=2, default=str)
            replace_atomically(tmp, path)
        except OSError as exc:  # checked before the run, but the file system may differ now
            with contextlib.suppress(OSError):
                remove_path(tmp)
            text = " ".join(str(exc).split())
            print(f"gadgetloader {command}: error: --json {path}: {text}", file=sys.stderr)
            return 1
        print(f"wrote {path}")
    return 0


#: the file extensions matplotlib's savefig writes (without a backend of its own)
_PLOT_FORMATS = (
    "png", "svg", "svgz", "pdf", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp", "raw", "rgba",
)  # fmt: skip


def _names_a_stream(path: str) -> bool:
    """Whether ``path`` is a descriptor's name (``/dev/stdout``, ``/dev/fd/N``,
    ``/proc/.../fd/N``) or, through any links, the file this process's standard output
    or error is (a run's own output redirected to the file it would replace)."""
    literal = os.path.normpath("/" + os.path.abspath(path).lstrip("/"))
    if (
        literal in ("/dev/stdin", "/dev/stdout", "/dev/stderr")
        or literal.startswith("/dev/fd/")
        or re.match(r"/proc/[^/]+/fd/", literal)
    ):
        return True
    try:
        st = os.stat(path)
    except OSError:
        return False
    for fd in (1, 2):
        try:
            std = os.fstat(fd)
        except OSError:
            continue
        if (std.st_dev, std.st_ino) == (st.st_dev, st.st_ino):
            return True
    return False


def _check_json_target(
    parser: argparse.ArgumentParser, path: str | None, option: str = "--json"
) -> None:
    """Refuse an output path (``--json``, ``--plot``, ``--profile``) that cannot be written,
    before running anything."""
    if path is None:
        return
    if not path:
        parser.error(f"{option}: an empty path; give a file name")
    if os.path.isdir(path):
        parser.error(f"{option} {path}: is a directory; give a file name")
    if path.endswith(("/", os.sep)):
        stem = path.rstrip("/" + os.sep)
        why = f"{stem} is a file" if os.path.exists(stem) else "that directory does not exist"
        parser.error(
            f"{option} {path}: names a directory (it ends with '/'), but {why}; give a file name"
        )
    # the folder as written must exist (realpath would resolve 'missing/..' without it)
    raw = os.path.dirname(path) or "."
    if not os.path.isdir(raw):
        parser.error(f"{option} {path}: no such directory {raw}")
    # a symbolic link is written through: the folder that must exist is its target's
    folder = os.path.dirname(os.path.realpath(path))
    if not os.path.isdir(folder):
        parser.error(f"{option} {path}: no such directory {folder}")
    if not os.access(folder, os.W_OK):
        parser.error(f"{option} {path}: {folder} is not writable")
    # the file is written beside its path and renamed into place: a device, a pipe or a
    # descriptor (/dev/stdout) would be replaced by a plain file, not written to
    # (--profile appends to its file instead)
    replaces = option != "--profile"
    if replaces and os.path.exists(path) and not os.path.isfile(path):
        parser.error(
            f"{option} {path}: it is not a regular file (a device, pipe or socket), and "
            f"{option} replaces what is at its path; give a file name"
        )
    if replaces and _names_a_stream(path):
        parser.error(
            f"{option} {path}: names a file descriptor or this run's standard "
            f"output or error, and {option} replaces what is at its path (it does "
            "not write to it); give a file name"
        )
    if os.path.exists(path) and not os.access(path, os.W_OK):
        parser.error(f"{option} {path}: the file is not writable")
    if option == "--plot":
        ext = os.path.splitext(path)[1].lower().lstrip(".")
        if ext not in _PLOT_FORMATS:
            parser.error(
                f"{option} {path}: the file name must end with an image format matplotlib "
                f"writes ({', '.join('.' + e for e in _PLOT_FORMATS)}); got "
                f"{'no extension' if not ext else '.' + ext}"
            )


def _failed_checks(result: Any, where: str = "") -> list[str]:
    """Where a benchmark's result failed its check against the reference: a ``check`` of
    ``WRONG`` / ``MISMATCH``, a ``checked`` or ``checks_passed`` that is False, a
    ``verified`` method that is False (the suites' own fields, wherever they are nested)."""
    bad: list[str] = []
    if isinstance(result, dict):
        label = " ".join(
            str(result[k]) for k in ("kind", "format", "method") if result.get(k) is not None
        ) or str(result.get("name") or where)
        if result.get("check") in ("WRONG", "MISMATCH") or result.get("checked") is False:
            bad.append(str(label))
        elif result.get("error") and _own_method(str(result.get("method", ""))):
            bad.append(f"{label} (raised)")  # a baseline that cannot run here is no failure
        if result.get("checks_passed") is False and not bad:
            bad.append("checks_passed")
        verified = result.get("verified")
        if isinstance(verified, dict):
            bad += [f"{name} (verified)" for name, ok in verified.items() if ok is False]
        for key, value in result.items():
            if key != "verified":
                bad += _failed_checks(value, str(key))
    elif isinstance(result, list):
        for item in result:
            bad += _failed_checks(item, where)
    return bad


def _own_method(name: str) -> bool:
    """Whether a benchmark method is gadgetloader's own (not a baseline such as torch's or
    SpeedTorch's, which may be missing or refuse a size on some machines)."""
    if "speedtorch" in name.lower():  # (SpeedTorch's DataGadget is a baseline)
        return False
    return name.lower().startswith("gadgetloader") or "Gadget" in name or "__getitems__" in name


def _check_bench_order(parser: argparse.ArgumentParser, argv: Sequence[str], suite: str) -> None:
    """Options written between ``bench`` and a suite name belong to the seed benchmark
    (``gadgetloader bench --rows N``); argparse would drop them silently for another suite."""
    words = list(argv)
    try:
        start = words.index("bench") + 1
        end = words.index(suite, start)
    except ValueError:
        return
    early = [w for w in words[start:end] if w.startswith("-")]
    if early:
        parser.error(
            f"{' '.join(early)} given before the suite name; put options after it: "
            f"gadgetloader bench {suite} {' '.join(words[start:end])}"
        )


def _check_bench_options(
    commands: dict[str, argparse.ArgumentParser], words: Sequence[str]
) -> None:
    """An option between ``bench`` and the suite name that the seed benchmark does not take
    is named as such (argparse would take the option's value for a suite name and report
    ``invalid choice: '3'``)."""
    words = list(words)
    head = words[: words.index("--")] if "--" in words else words
    if {"-h", "--help", "--version"} & set(head):
        return  # help and the version win over a bad option, as argparse has it
    first = next((k for k, w in enumerate(words) if not w.startswith("-")), None)
    if first is None or words[first] != "bench":
        return
    bench = commands["bench"]
    known = {o: a for a in bench._actions for o in a.option_strings}
    k = first + 1
    while k < len(words):
        word = words[k]
        if word == "--" or not word.startswith("-") or word == "-":
            return  # the suite name (or a positional): argparse takes it from here
        name = word.split("=", 1)[0]
        matches = [o for o in known if o == name] or [
            o for o in known if o.startswith(name) and name.startswith("--")
        ]
        if len(matches) == 1:
            action = known[matches[0]]
            k += 1 if ("=" in word or action.nargs == 0) else 2
            continue
        if len(matches) > 1:
            return  # ambiguous: argparse says so
        owners = [
            key.split(" ", 1)[1]
            for key, sp in commands.items()
            if key.startswith("bench ") and any(name in a.option_strings for a in sp._actions)
        ]
        where = (
            f"; it is an option of `gadgetloader bench {owners[0]}`: put it after the suite name"
            if len(owners) == 1
            else f"; it is an option of the suites {', '.join(owners)}: put it after the suite name"
            if owners
            else ""
        )
        bench.error(f"unrecognized arguments: {word} (not an option of the seed benchmark{where})")


class _PipeGuard:
    """``sys.stdout`` during a benchmark: once the reader of a pipe has gone (`| head`),
    further output is dropped instead of raising, so that the run ends and its results
    still reach ``--json``; the caller then stops quietly."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.closed_pipe = False

    def write(self, text: str) -> int:
        if not self.closed_pipe:
            try:
                return int(self.stream.write(text))
            except BrokenPipeError:
                self._drop()
        return len(text)

    def flush(self) -> None:
        if not self.closed_pipe:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._drop()

    def _drop(self) -> None:
        self.closed_pipe = True
        with contextlib.suppress(OSError):  # Python's own flush at exit must not fail either
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self.stream, name)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gadgetloader`` console script."""
    try:
        status = _main(argv)
        sys.stdout.flush()  # here, not at exit: a closed pipe is handled below
        return status
    except KeyboardInterrupt:
        print("gadgetloader: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout was closed early (`| head`): stop quietly, as command-line tools do
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: Sequence[str] | None) -> int:
    parser, commands = _parsers()
    words = list(sys.argv[1:] if argv is None else argv)
    _check_bench_options(commands, words)
    args, extra = parser.parse_known_args(words)
    if args.command == "bench" and args.suite:
        _check_bench_order(commands["bench"], words, args.suite)
    # usage errors found below name the command given (`gadgetloader bench sweep: error:`)
    suite = getattr(args, "suite", None)
    parser = commands.get(f"{args.command} {suite}" if suite else args.command, parser)
    if extra:  # (argparse would name the top-level command and print its usage)
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command in ("bench", "info"):
        _check_json_target(parser, getattr(args, "json", None))
        outputs: dict[str, str] = {}
        for option in ("json", "plot", "profile"):
            path = getattr(args, option, None)
            if option != "json":
                _check_json_target(parser, path, f"--{option}")
            if path:
                real = os.path.realpath(path)
                if real in outputs:
                    parser.error(f"--{outputs[real]} and --{option} name the same file {path}")
                outputs[real] = option
        folder = getattr(args, "dir", None)
        if folder is not None and os.path.exists(folder) and not os.path.isdir(folder):
            parser.error(f"--dir {folder}: is not a directory")
    if args.command == "info":
        from .info import collect_info, format_info

        data = collect_info(measure=not args.no_measure)
        status = _write_json(args.json, data, "info")  # first: the file is kept even if
        print(format_info(data))  # stdout is a closed pipe (`| head -1`)
        return status
    if args.command == "bench":
        from ._errors import GadgetError
        from .bench._common import OptionError

        module = _SUITES[args.suite or "seed"][0]
        stdout = _PipeGuard(sys.stdout)
        sys.stdout = stdout  # type: ignore[assignment]
        try:
            result = importlib.import_module(module).run(args)
        except OptionError as exc:  # a bad option found after parsing: a usage error too
            parser.error(str(exc))
        except (GadgetError, OSError) as exc:  # a file system problem: one line
            print(f"gadgetloader bench: error: {exc}", file=sys.stderr)
            return 1
        except (MemoryError, ValueError) as exc:  # a size beyond this machine's RAM: one line too
            if isinstance(exc, ValueError) and "too big" not in str(exc):
                raise  # (NumPy: "array is too big" for a byte count beyond 64 bits)
            print(
                f"gadgetloader bench: error: not enough memory for the sizes asked "
                f"({type(exc).__name__}: {str(exc)[:200]}); choose smaller sizes",
                file=sys.stderr,
            )
            return 1
        except RuntimeError as exc:
            text = str(exc).lower()
            import torch

            oom = isinstance(exc, getattr(torch.cuda, "OutOfMemoryError", ())) or (
                "out of memory" in text
                or "can't allocate memory" in text
                or "storage size calculation overflowed" in text  # beyond 64 bits of bytes
            )
            if not oom:  # a crash (an illegal address, an assert) keeps its traceback
                raise
            print(
                f"gadgetloader bench: error: not enough memory for the sizes asked "
                f"({str(exc).splitlines()[0][:200]}); choose smaller sizes",
                file=sys.stderr,
            )
            return 1
        except KeyboardInterrupt:
            print("gadgetloader bench: interrupted", file=sys.stderr)
            return 130
        finally:
            sys.stdout = stdout.stream
        status = _write_json(getattr(args, "json", None), result, "bench")
        if stdout.closed_pipe:  # the results reached --json; stop quietly (see main)
            raise BrokenPipeError
        bad = sorted(set(_failed_checks(result)))
        if bad:  # a wrong result is a failed run, whatever the timings say (exit status 1)
            print(
                f"gadgetloader bench: error: results that failed their check against the "
                f"reference: {', '.join(bad)}",
                file=sys.stderr,
            )
            return 1
        return status
    if args.command == "convert":
        from .bench._common import OptionError

        try:
            return int(importlib.import_module("gadgetloader.convert").run(args) or 0)
        except OptionError as exc:  # a bad option value found after parsing
            parser.error(str(exc))
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
