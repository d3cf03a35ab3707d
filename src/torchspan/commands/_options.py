"""The options several commands take, defined once so that one name means one thing with one help text.

``plan``, ``run`` and ``verify`` take a TARGET and its example batch (``add_target_arguments``); the
pipeline options (``--devices``, ``--microbatches``, ``--schedule``, ``--recompute``), process counts
(``--nproc-per-node``), ``--json`` and ``--out`` are added by the functions below wherever a command has
them. Choices come from the library's constants (``torchspan.schedule``). ``tests/test_cli_vocabulary.py``
checks that the commands agree.

Usage::

    add_target_arguments(p, "a floating dtype also casts the model to it")
    add_schedule_option(p, default="auto")          # auto and torchspan.schedule.SCHEDULES
    add_json_option(p, "the plan")
"""

from __future__ import annotations

import argparse

from ..schedule import PRECISIONS, RECOMPUTE_MODES, SCHEDULES

__all__ = [
    "DEFAULT_VOCAB",
    "add_target_arguments",
    "add_memory_option",
    "add_devices_option",
    "add_microbatches_option",
    "add_schedule_option",
    "add_recompute_option",
    "add_precision_option",
    "add_nproc_option",
    "add_seed_option",
    "add_json_option",
    "add_out_option",
]

DEFAULT_VOCAB = 2  # integer inputs are token ids in [0, 2): valid ids for any embedding, and 0/1 masks
DEFAULT_INPUT_DTYPE = "float32"
AUTO = "auto"


def add_target_arguments(p: argparse.ArgumentParser, dtype_effect: str) -> None:
    """TARGET and its example batch: ``--input-shape``, ``--input NAME=SHAPE[:DTYPE]`` (repeatable),
    ``--input-dtype`` (alias ``--dtype``; dest ``dtype``) and ``--vocab``, alike in every command that
    builds a target; ``dtype_effect`` says what the dtype does to the model in this command.

    Usage: ``add_target_arguments(p, "a floating dtype also casts the model to it")``.
    """
    p.add_argument(
        "target",
        metavar="TARGET",
        help="package.module:factory or path/to/file.py:factory returning the model",
    )
    p.add_argument(
        "--input-shape",
        metavar="B,D...",
        help="shape of one positional input batch, batch first, e.g. 32,512 (or keyword inputs with --input)",
    )
    p.add_argument(
        "--input",
        action="append",
        metavar="NAME=SHAPE[:DTYPE]",
        help="a keyword input of the forward, batch first (repeatable), e.g. --input input_ids=8,128:int64 "
        "--input attention_mask=8,128:int64; integer inputs are drawn from [0, --vocab) (masks: --vocab 2 "
        "or a bool dtype)",
    )
    p.add_argument(
        "--input-dtype",
        "--dtype",
        dest="dtype",
        metavar="DTYPE",
        default=DEFAULT_INPUT_DTYPE,
        help=f"dtype of the input, also of --input without :DTYPE (default {DEFAULT_INPUT_DTYPE}); "
        f"integer dtypes are token ids in [0, --vocab); {dtype_effect}",
    )
    p.add_argument(
        "--vocab",
        type=int,
        default=DEFAULT_VOCAB,
        metavar="VOCAB",
        help=f"integer inputs are token ids drawn from [0, VOCAB) (default {DEFAULT_VOCAB})",
    )


def add_memory_option(p: argparse.ArgumentParser) -> None:
    """``--memory DEV=SIZE`` (repeatable): a device's memory budget."""
    p.add_argument(
        "--memory",
        action="append",
        metavar="DEV=SIZE",
        help="memory budget for a device, e.g. cuda:0=10GiB or cpu=32GB (repeatable; default: what the "
        "device has free)",
    )


def add_devices_option(
    p: argparse.ArgumentParser, what: str, *, default: str | None, default_text: str | None = None
) -> None:
    """``--devices SPEC``: ``what`` the devices are for; ``default_text`` shows a ``None`` default (e.g.
    ``"auto"``)."""
    shown = default_text if default_text is not None else default
    p.add_argument(
        "--devices",
        metavar="SPEC",
        default=default,
        help=f"{what}: a device spec, e.g. cpu, 'cpu,cpu' or 'cuda:0,cpu' (default {shown})",
    )


def add_microbatches_option(p: argparse.ArgumentParser, *, auto: bool, default: str | int | None) -> None:
    """``--microbatches``: an integer >= 1, or also ``auto`` where a search chooses it (``auto=True``; parsed
    later with ``_common.parse_microbatches``); without ``auto``, an int (``type=int``)."""
    if auto:
        p.add_argument(
            "--microbatches",
            metavar="N|auto",
            default=default,
            help="micro-batches per step: an integer >= 1, or auto for the planner's choice (default auto)",
        )
    else:
        p.add_argument(
            "--microbatches",
            metavar="N",
            type=int,
            default=default,
            help=f"micro-batches per step: an integer >= 1 (default {default})",
        )


def _choices(auto: bool, names: tuple[str, ...]) -> tuple[str, ...]:
    return (AUTO, *names) if auto else tuple(names)


def _default_text(default: str | None) -> str:
    return f"default {default if default is not None else AUTO}"


def add_schedule_option(p: argparse.ArgumentParser, *, default: str | None) -> None:
    """``--schedule``: ``torchspan.schedule.SCHEDULES``, plus ``auto`` (the planner chooses) unless the
    default is a schedule."""
    auto = default in (None, AUTO)
    p.add_argument(
        "--schedule",
        choices=_choices(auto, SCHEDULES),
        default=default,
        help="pipeline schedule"
        + ("; auto: the planner's choice" if auto else "")
        + f" ({_default_text(default)})",
    )


def add_recompute_option(p: argparse.ArgumentParser, *, default: str | None) -> None:
    """``--recompute``: ``torchspan.schedule.RECOMPUTE_MODES`` (plus ``auto`` unless the default is a mode);
    ``--checkpoint`` stays a hidden alias (same dest) so older command lines work."""
    auto = default in (None, AUTO)
    choices = _choices(auto, RECOMPUTE_MODES)
    p.add_argument(
        "--recompute",
        choices=choices,
        default=default,
        help="activation recompute (activation checkpointing): never keeps each micro-batch's activations, "
        "always "
        "recomputes the forward in backward, except_last does so for all but a stage's last micro-batch in "
        "flight" + ("; auto: the planner's choice" if auto else "") + f" ({_default_text(default)})",
    )
    p.add_argument(
        "--checkpoint", dest="recompute", choices=choices, default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )


def add_precision_option(p: argparse.ArgumentParser, note: str = "") -> None:
    """``--precision``: ``torchspan.schedule.PRECISIONS`` (default ``"32"``)."""
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=PRECISIONS[0],
        help="autocast with fp32 master weights: bf16, or fp16 with a gradient scaler (default "
        f"{PRECISIONS[0]}){note}",
    )


def add_nproc_option(p: argparse.ArgumentParser, what: str, *, default: int | None) -> None:
    """``--nproc-per-node N`` (alias ``--nproc``): gloo processes on this machine for ``what``."""
    p.add_argument(
        "--nproc-per-node",
        "--nproc",
        dest="nproc_per_node",
        type=int,
        default=default,
        metavar="N",
        help=f"{what} (default {default if default is not None else 'none: one process'})",
    )


def add_seed_option(p: argparse.ArgumentParser) -> None:
    """``--seed``: the seed of the synthetic batch and targets."""
    p.add_argument("--seed", type=int, default=0, help="seed for the synthetic batch and targets (default 0)")


def add_json_option(p: argparse.ArgumentParser, what: str, note: str = "") -> None:
    """``--json``: print ``what`` as JSON on stdout instead of tables; ``note`` says where other output
    goes."""
    p.add_argument("--json", action="store_true", help=f"print {what} as JSON instead of tables{note}")


def add_out_option(p: argparse.ArgumentParser, kind: str, what: str, *, default: str | None = None) -> None:
    """``--out FILE`` (``kind="FILE"``: one file) or ``--out DIR`` (``kind="DIR"``: a folder, created if
    missing)."""
    if kind not in ("FILE", "DIR"):
        raise ValueError(f"kind={kind!r} is not 'FILE' or 'DIR'")
    tail = f"; default {default}" if default is not None else ""
    where = (
        "to the file FILE (its folder is created if missing"
        if kind == "FILE"
        else "into the folder DIR (created if missing"
    )
    p.add_argument("--out", metavar=kind, default=default, help=f"write {what} {where}{tail})")
