"""The model a command works on: load and build TARGET, make its synthetic batch, call it once.

``plan``, ``run`` and ``verify`` share this path, so the same mistake reads the same in each: a
factory that fails, a model without parameters, a batch too large for this machine, a batch the
forward rejects, a device that holds no data. Every failure is a one-line ``UsageError`` naming the
option, the value and the fix.

Usage::

    model = build_model(args.target)
    x = make_batch((32, 512), torch.float32, vocab=2, option="--input-shape 32,512")
    out = first_call(model, x, "--input-shape/--dtype")
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ._common import UsageError, load_target, synthetic_batch

__all__ = [
    "require_inputs",
    "build_model",
    "build_for_verify",
    "caches_off",
    "dropout_off",
    "make_batch",
    "example_inputs",
    "model_dtype",
    "first_call",
    "require_data_devices",
]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def build_model(target: str, *, meta: bool = False) -> nn.Module:
    """The model TARGET builds (see ``load_target``); one without parameters is refused: nothing to place or
    train.

    ``meta``: build it under ``torch.device("meta")`` (parameters hold shapes, no memory, no initialisation
    compute), for planning on described devices only: a model larger than this machine's memory plans in
    seconds.
    """
    if meta:
        with torch.device("meta"):
            model = load_target(target)
    else:
        model = load_target(target)
    if next(iter(model.parameters()), None) is None:
        raise UsageError(
            f"TARGET {target!r} builds a {type(model).__name__} without parameters: there is nothing to "
            "place or train; return the model with its weights (e.g. nn.Sequential(nn.Linear(16, 4), "
            "nn.ReLU()))"
        )
    return model


def caches_off(model: nn.Module) -> nn.Module:
    """``model`` with every config's ``use_cache`` set False (transformers models default to True): a training
    step needs no generation cache, and its tensors (with autograd history) cannot be sent to spawned
    ranks."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True:
            config.use_cache = False
    return model


def dropout_off(model: nn.Module) -> str | None:
    """Every dropout module of ``model`` (``nn.Dropout`` and its kin) with ``p > 0`` set to ``p = 0``, and a
    note naming them (``None`` when there are none): a batch split into micro-batches or shards draws other
    masks than the whole batch does, so a step with dropout cannot equal one device's, and ``verify``
    compares the computation without it (as transformers models ship it: ``GPT2Config``'s 0.1).
    Usage: ``note = dropout_off(model)``."""
    found = []
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            found.append((name, m.p))
            m.p = 0.0
    if not found:
        return None
    listed = ", ".join(f"{n or type(model).__name__} p={p:g}" for n, p in found[:4])
    more = f" and {len(found) - 4} more" if len(found) > 4 else ""
    return (
        f"dropout off in {len(found)} module(s) ({listed}{more}) for the comparison: a batch split into "
        "micro-batches or shards draws other masks than the whole batch, so no step with dropout equals one "
        "device's; torchspan trains with it as given"
    )


def build_for_verify(target: str) -> nn.Module:
    """``load_target(target)`` with its caches (``caches_off``) and dropout (``dropout_off``) off: what each
    rank of ``verify --strategies`` builds (module-level, so ``functools.partial(build_for_verify, target)``
    pickles)."""
    model = caches_off(load_target(target))
    dropout_off(model)
    return model


def _free_cpu_bytes() -> int | None:
    from ..hardware import devices

    return devices("cpu")[0].free_memory


def make_batch(shape: Sequence[int], dtype: torch.dtype, vocab: int, *, option: str) -> torch.Tensor:
    """``synthetic_batch`` in CPU memory, or a ``UsageError`` saying the batch does not fit and which batch
    would.

    ``option`` is the option as the user wrote it (``"--input-shape 100000000000,16"``).
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_sample = math.prod(shape[1:]) * itemsize
    need = shape[0] * per_sample
    free = _free_cpu_bytes()
    if free is not None and need > free:
        raise UsageError(_too_big(shape, dtype, need, free, per_sample, option))
    try:
        return synthetic_batch(tuple(shape), dtype, vocab)
    except (RuntimeError, MemoryError) as exc:  # the allocator's refusal (free memory is only an estimate)
        if isinstance(exc, MemoryError) or "alloc" in str(exc).lower():
            raise UsageError(_too_big(shape, dtype, need, free, per_sample, option)) from exc
        raise


def _too_big(
    shape: Sequence[int], dtype: torch.dtype, need: int, free: int | None, per_sample: int, option: str
) -> str:
    from ..hardware import format_bytes

    room = free if free is not None else need // 2
    batch = max(1, (room // 4) // max(1, per_sample))  # a quarter of free memory leaves room for the model
    smaller = ",".join(str(d) for d in (min(batch, shape[0] - 1 or 1), *shape[1:]))
    where = (
        f"this machine's free memory ({format_bytes(free)})"
        if free is not None
        else "what this machine could allocate"
    )
    return (
        f"{option}: one {str(dtype).replace('torch.', '')} batch of this shape is {format_bytes(need)}, "
        f"more than {where}; torchspan builds the example batch in CPU memory. Plan a smaller batch: "
        f"--input-shape {smaller} takes a quarter of that memory at most"
    )


def require_inputs(input_shape: str | None, named: Sequence[str] | None, dtype_option: str) -> None:
    """Exactly one of ``--input-shape`` and ``--input``, else a ``UsageError`` (checked before the model is
    built).

    Usage: ``require_inputs(args.input_shape, args.input, "--dtype")``.
    """
    if not input_shape and not named:
        raise UsageError(
            f"give the input: --input-shape 32,512 [{dtype_option} int64], or named inputs --input "
            "input_ids=8,128:int64"
        )
    if input_shape and named:
        raise UsageError(
            "give either --input-shape (one positional input) or --input NAME=SHAPE (keyword inputs), not "
            "both"
        )


def example_inputs(
    input_shape: str | None, named: Sequence[str] | None, dtype: torch.dtype, vocab: int, dtype_option: str
) -> tuple[Any, int, str]:
    """The example batch from ``--input-shape`` or ``--input NAME=SHAPE[:DTYPE]`` (exactly one of them).

    Returns ``(inputs, batch_size, options)``: a tensor or a dict of keyword tensors, dim 0 of it, and
    the options that set it as a user would retype them (for hints naming a command to re-run).
    Usage: ``x, batch, hint = example_inputs(args.input_shape, args.input, torch.int64, 2, "--dtype")``.
    """
    from ._common import named_inputs, parse_shape

    require_inputs(input_shape, named, dtype_option)
    if named:
        inputs = named_inputs(named, vocab, dtype)
        assert inputs is not None
        return (
            inputs,
            int(next(iter(inputs.values())).shape[0]),
            " ".join(f"--input {item}" for item in named),
        )
    assert input_shape is not None
    shape = parse_shape(input_shape)
    return (
        make_batch(shape, dtype, vocab, option=f"--input-shape {input_shape}"),
        shape[0],
        f"--input-shape {input_shape}",
    )


def model_dtype(dtype: torch.dtype, example: Any) -> torch.dtype | None:
    """The dtype ``--dtype`` casts the model to: ``dtype`` when it is floating and reached a floating
    input; ``None`` (the model keeps the dtype it was built in) when every input is integer, as
    ``--input input_ids=8,2048:int64`` gives a bfloat16 model. Usage: ``cast = model_dtype(dtype, x)``."""
    from torch.utils._pytree import tree_leaves

    floats = [t for t in tree_leaves(example) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return dtype if (dtype.is_floating_point or dtype.is_complex) and floats else None


def first_call(model: nn.Module, x: Any, options: str, *, vocab: int | None = None) -> Any:
    """One forward of ``model`` on ``x`` (no gradients, eval mode, on the model's own device); its output.

    A forward that raises becomes a ``UsageError`` naming the batch and ``options``, the options that
    set it (``"--input-shape/--dtype"``). ``vocab``: integer inputs are token ids in ``[0, vocab)``.
    """
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    modes = {m: m.training for m in model.modules()}
    model.eval()
    from ..profiler.sizing import meta_forward

    try:
        with (
            torch.no_grad(),
            meta_forward(model),
        ):  # a meta model: shapes only, under FakeTensorMode as the profiler does
            if isinstance(x, dict):  # named inputs are keyword arguments
                return model(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in x.items()})
            return model(x.to(device) if isinstance(x, torch.Tensor) else x)
    except Exception as exc:
        what = _describe(x, vocab)
        fix = f"{options}/--vocab" if "token ids" in what else options
        rows = _embedding_rows(model) if "token ids" in what else None
        hint = (
            f" (its input embedding has {rows} rows: --vocab {rows} or less)"
            if rows is not None and vocab is not None and vocab > rows
            else ""
        )
        raise UsageError(
            f"the model rejects {what}: {_first_line(exc)}; set {fix} to what its forward expects{hint}"
        ) from exc
    finally:
        for m, training in modes.items():
            m.training = training


def _integers(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not (
        x.is_floating_point() or x.is_complex() or x.dtype == torch.bool
    )


def _embedding_rows(model: nn.Module) -> int | None:
    """The rows of the model's input embedding (transformers' ``get_input_embeddings()``, else its first
    ``nn.Embedding``): token ids at or past them are out of range."""
    try:
        found = model.get_input_embeddings()  # type: ignore[operator]
    except Exception:
        found = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return int(found.num_embeddings) if isinstance(found, nn.Embedding) else None


def _describe(x: Any, vocab: int | None) -> str:
    if isinstance(x, dict):
        shown = ", ".join(
            f"{k}={','.join(map(str, v.shape))}:{str(v.dtype).replace('torch.', '')}"
            if isinstance(v, torch.Tensor)
            else k
            for k, v in x.items()
        )
        ids = (
            f" (integer inputs are token ids in [0, {vocab}))"
            if vocab is not None and any(_integers(v) for v in x.values())
            else ""
        )
        return f"the keyword inputs {shown}{ids}"
    if not isinstance(x, torch.Tensor):
        return f"the example inputs ({type(x).__name__})"
    dtype = str(x.dtype).replace("torch.", "")
    ids = f" (token ids in [0, {vocab}))" if vocab is not None and _integers(x) else ""
    return f"a batch of shape {','.join(map(str, x.shape))} {dtype}{ids}"


def require_data_devices(entries: Sequence[str], option: str, *, fix: str | None = None) -> None:
    """Refuse ``meta`` among devices a command trains on: it holds shapes only, so nothing can run there.

    ``option`` names where the devices came from (``"--devices"``); ``fix`` replaces the default advice.
    """
    meta = [e for e in entries if str(e).strip().lower().split(":", 1)[0] == "meta"]
    if meta:
        listed = ",".join(str(e).strip() for e in entries)
        others = ",".join(str(e).strip() for e in entries if e not in meta) or "cpu"
        raise UsageError(
            f"{option} {listed!r}: meta holds shapes, not data, so no step can run on it; "
            + (
                fix
                or f"train on devices with memory, e.g. {option} {others}, and plan for meta with "
                "`torchspan plan` only"
            )
        )
