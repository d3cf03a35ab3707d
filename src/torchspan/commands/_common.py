"""Helpers shared by subcommands: ``UsageError``, parsing ``DEV=SIZE``, shapes, dtypes and micro-batches,
targets, batches, the rich console.

The options themselves are defined in ``_options``.

Usage: ``raise UsageError("--steps '0' must be >= 1")``; ``parse_memory_options(["cpu=32GB"])``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console


class UsageError(ValueError):
    """Bad command-line input; printed as ``torchspan: error: …`` with exit status 2."""


def parse_memory_options(items: Sequence[str] | None) -> dict[str, str] | None:
    """``["cuda:0=10GiB", "cpu=32GB"]`` → ``{"cuda:0": "10GiB", "cpu": "32GB"}``."""
    if not items:
        return None
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise UsageError(
                f"--memory {item!r} is not DEV=SIZE; write e.g. --memory cuda:0=10GiB --memory cpu=32GB"
            )
        out[key.strip()] = value.strip()
    return out


_LEADING_MINUS = re.compile(r"^-\.?\d")  # -8,16  -1e-3  -.5: a value, not an option


def join_negative_values(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``--input-shape -8,16`` -> ``--input-shape=-8,16`` for options that take a value, so that a negative
    value reaches the command's own check (argparse takes ``-8,16`` for an option and says only
    "expected one argument"). ``launch`` is left alone: what follows its SCRIPT is the script's.
    """
    argv = list(argv)
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    command = next((w for w in argv if not w.startswith("-")), None)
    if sub is None or command not in sub.choices or command == "launch":
        return argv
    takes_value = {s for a in sub.choices[command]._actions for s in a.option_strings if a.nargs is None}
    out: list[str] = []
    words = iter(argv)
    for word in words:
        if word == "--":
            out += [word, *words]
            break
        nxt = next(words, None) if word in takes_value else None
        if nxt is not None and _LEADING_MINUS.match(nxt):
            out.append(f"{word}={nxt}")
        else:
            out += [word] + ([nxt] if nxt is not None else [])
    return out


def console(file: Any = None) -> Console:
    """A console on ``file`` (default stdout); plain text (no colour codes) when it is not a terminal.

    ``markup=False``: strings print as they are. Model output, paths, hints such as
    ``pip install 'torchspan[bench]'`` and type names such as ``dict[str, Any]`` keep their square
    brackets (rich markup would take ``[bench]`` for a style and drop it); styled text is a
    ``rich.text.Text``.
    """
    file = sys.stdout if file is None else file
    tty = file.isatty() if hasattr(file, "isatty") else False
    return Console(file=file, markup=False, highlight=False, soft_wrap=False, width=None if tty else 120)


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=False))


def json_float(value: float) -> float | str:
    """``value`` for JSON, which has no infinity or NaN: those as ``"inf"`` / ``"nan"``."""
    return value if math.isfinite(value) else str(value)


def load_target(target: str) -> Any:
    """Build the model named by ``package.module:factory`` or ``path/to/file.py:factory``.

    ``factory`` is called with no arguments and must return an ``nn.Module`` (a module-level
    ``nn.Module`` instance is accepted as is).
    """
    import importlib
    import importlib.util
    import os

    from torch import nn

    where, sep, attr = target.rpartition(":")
    if not sep or not where or not attr:
        raise UsageError(
            f"TARGET {target!r} is not 'package.module:factory' or 'path/to/file.py:factory'; "
            "e.g. 'mymodels:build' or 'train.py:make_model'"
        )
    if where.endswith(".py") or os.sep in where:
        if not os.path.isfile(where):
            raise UsageError(f"TARGET {target!r}: file {where!r} does not exist")
        spec = importlib.util.spec_from_file_location(f"_torchspan_target_{abs(hash(where))}", where)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except (
            Exception
        ) as exc:  # a syntax error or a failing import in the user's file: one line, not a traceback
            raise UsageError(f"TARGET {target!r}: running {where!r} failed with {_one_line(exc)}") from exc
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise UsageError(
                f"TARGET {target!r}: cannot import module {where!r} ({exc}); check PYTHONPATH"
            ) from exc
        except Exception as exc:
            raise UsageError(f"TARGET {target!r}: importing {where!r} failed with {_one_line(exc)}") from exc
    if not hasattr(module, attr):
        raise UsageError(f"TARGET {target!r}: {where!r} has no attribute {attr!r}")
    obj = getattr(module, attr)
    if not isinstance(obj, nn.Module) and not callable(obj):
        raise UsageError(
            f"TARGET {target!r}: {attr} is a {type(obj).__name__}; name a function returning the model, or "
            "an nn.Module"
        )
    try:
        model = obj if isinstance(obj, nn.Module) else obj()
    except Exception as exc:
        raise UsageError(f"TARGET {target!r}: building the model failed with {_one_line(exc)}") from exc
    if not isinstance(model, nn.Module):
        raise UsageError(f"TARGET {target!r}: {attr}() returned {type(model).__name__}, not an nn.Module")
    return model


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def parse_shape(text: str, option: str = "--input-shape") -> tuple[int, ...]:
    """``"32,512"`` (or ``"32x512"``) → ``(32, 512)``; positive sizes only, batch first."""
    try:
        dims = tuple(int(x) for x in text.replace("x", ",").split(","))
    except ValueError:
        dims = ()
    if not dims or any(d < 1 for d in dims):
        raise UsageError(
            f"{option} {text!r} is not a shape; write positive sizes separated by commas, batch first, "
            "e.g. 32,512"
        )
    return dims


def parse_dtype(text: str, option: str = "--dtype") -> Any:
    """``"float32"`` / ``"torch.int64"`` → the ``torch.dtype``."""
    import torch

    value = getattr(torch, text.strip().removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise UsageError(
            f"{option} {text!r} is not a torch dtype; use e.g. float32, bfloat16, float16 or int64"
        )
    return value


def parse_microbatches(text: str, option: str = "--microbatches") -> int | str:
    """``"auto"`` or an integer >= 1."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise UsageError(f"{option} {text!r} must be 'auto' or an integer >= 1")
    return value


def synthetic_batch(shape: tuple[int, ...], dtype: Any, vocab: int) -> Any:
    """A random batch: normal floats, random booleans, or integer ids drawn from ``[0, vocab)``.

    Usage: ``x = synthetic_batch((32, 512), torch.float32, vocab=2)``.
    """
    import torch

    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape).bool()
    return torch.randint(0, vocab, shape, dtype=dtype)


def named_inputs(items: Sequence[str] | None, vocab: int, default_dtype: Any = None) -> dict[str, Any] | None:
    """``["input_ids=8,128:int64", "mask=8,128:bool"]`` → ``{"input_ids": tensor, "mask": tensor}`` (random;
    None without items).

    Usage: ``named_inputs(args.input, args.vocab)``.
    """
    if not items:
        return None
    out: dict[str, Any] = {}
    for item in items:
        name, sep, rest = item.partition("=")
        if not sep or not name.strip().isidentifier() or not rest.strip():
            raise UsageError(
                f"--input {item!r} is not NAME=SHAPE[:DTYPE]; write e.g. --input input_ids=8,128:int64"
            )
        shape_text, _, dtype_text = rest.partition(":")
        shape = parse_shape(shape_text, f"--input {name}")
        dtype = (
            parse_dtype(dtype_text, f"--input {name}")
            if dtype_text
            else (default_dtype or parse_dtype("float32"))
        )
        if name.strip() in out:
            raise UsageError(f"--input {name.strip()} is given twice; give each keyword input once")
        out[name.strip()] = synthetic_batch(shape, dtype, vocab)
    batches = {k: tuple(v.shape)[0] for k, v in out.items()}
    if len(set(batches.values())) > 1:
        raise UsageError(
            f"--input batch sizes differ ({', '.join(f'{k}: {b}' for k, b in batches.items())}); dim 0 is "
            "the batch, give all inputs the same"
        )
    return out
