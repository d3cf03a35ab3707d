"""``torchspan.doctor``: audit a model, loss, optimizer, batch and checkpoint for device problems.

The static part only reads devices, names and keys; nothing runs. With example inputs (or
``run=True``) it then runs one forward — and a backward when ``loss_fn`` is given — under
:func:`torchspan.watch`, restoring gradients and buffers afterwards.

Usage::

    report = torchspan.doctor(model, x, target=y, loss_fn=criterion, optimizer=opt)
    print(report)            # findings with severity and fix
    report.ok                # False when any error was found
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .dataparallel import audit_dataparallel, audit_state_dict
from .mismatch import DeviceMismatchError, dtype_name, is_cpu_scalar, unregistered_parameter_fix
from .naming import named_tensors
from .optimizer import audit_optimizer
from .report import Finding, Report, name_list
from .ties import audit_ties
from .watcher import watch

__all__ = [
    "doctor",
    "audit_modules",
    "audit_batch",
    "audit_optimizer",
    "looks_like_device_error",
]


def _majority(devices: list[str]) -> str | None:
    return Counter(devices).most_common(1)[0][0] if devices else None


def _first_layer(model: nn.Module, prefix: str) -> tuple[str, nn.Module, str] | None:
    """The first module (registration order) that owns a parameter or buffer, with its device."""
    for path, mod in model.named_modules():
        own = list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False))
        if own:
            return (f"{prefix}.{path}" if path else prefix), mod, str(own[0].device)
    return None


def _last_layer(model: nn.Module, prefix: str) -> tuple[str, nn.Module, str] | None:
    last = None
    for path, mod in model.named_modules():
        own = list(mod.parameters(recurse=False))
        if own:
            last = (f"{prefix}.{path}" if path else prefix), mod, str(own[0].device)
    return last


# ---------------------------------------------------------------------- modules and loss


def audit_modules(
    model: nn.Module,
    loss_fn: Any = None,
    target_device: str | None = None,
    *,
    names: tuple[str, str] = ("model", "loss_fn"),
) -> list[Finding]:
    """Parameters/buffers of ``model`` split over devices; ``loss_fn`` tensors off the loss's device.

    Usage: ``audit_modules(model, criterion, target_device="cuda:0")``.
    """
    mname, lname = names
    findings: list[Finding] = []
    tensors = named_tensors(model, mname)
    groups: dict[str, list[str]] = {}
    for _, qual, t in tensors:
        groups.setdefault(str(t.device), []).append(qual)
    if len(groups) > 1:
        main = max(groups, key=lambda d: len(groups[d]))
        odd = [d for d in groups if d != main]
        findings.append(
            Finding(
                code="model-split",
                severity="warning",
                title=f"{mname} has parameters and buffers on {len(groups)} devices "
                f"({', '.join(sorted(groups))})",
                where=mname,
                details=[
                    f"{dev}: {name_list(groups[dev])}" for dev in sorted(groups, key=lambda d: d != main)
                ],
                fix=(
                    f"if the split is deliberate (model parallel), move activations between the parts in "
                    f"forward (`x = x.to('{odd[0]}')` before the first layer on {odd[0]}); otherwise move "
                    f"the whole model: `{mname}.to('{main}')`"
                ),
            )
        )
    findings.extend(_tensor_attributes(model, mname))

    if isinstance(loss_fn, nn.Module):
        ltensors = named_tensors(loss_fn, lname)
        ref, why = target_device, "the target"
        if ref is None:
            last = _last_layer(model, mname)
            if last is not None:
                ref, why = last[2], f"the model's output (last layer `{last[0]}`)"
        stray = [(k, q, t) for k, q, t in ltensors if ref is not None and str(t.device) != ref]
        if stray:
            kind, qual, t = stray[0]
            findings.append(
                Finding(
                    code="loss-device",
                    severity="error" if target_device is not None else "warning",
                    title=f"{lname} {kind} `{qual}` is on {t.device} but {why} is on {ref}",
                    where=f"{lname} ({type(loss_fn).__name__})",
                    details=[f"{t.device}: {name_list([q for _, q, _ in stray])}"],
                    fix=(
                        f"call `{lname}.to('{ref}')`: a loss's buffers (e.g. CrossEntropyLoss(weight=...)) "
                        f"stay where they were made until the loss module itself is moved"
                    ),
                )
            )
        findings.extend(_tensor_attributes(loss_fn, lname))
    return findings


def _tensor_attributes(root: nn.Module, prefix: str) -> list[Finding]:
    """Plain tensor attributes (not buffers) on another device than their module's parameters."""
    out: list[Finding] = []
    for path, mod in root.named_modules():
        candidates = [
            (attr, val)
            for attr, val in vars(mod).items()
            if isinstance(val, torch.Tensor) and not attr.startswith("_") and not is_cpu_scalar(val)
        ]
        if not candidates:  # the usual case: no need to look at the module's tensors at all
            continue
        for attr, val in candidates:  # self.w = nn.Parameter(t).cuda(1): wherever it is, nothing trains it
            if val.requires_grad and not isinstance(val, nn.Parameter):
                qual = f"{prefix}.{path}.{attr}" if path else f"{prefix}.{attr}"
                title = (
                    f"`{qual}` requires grad but is a plain tensor attribute on {val.device}, not a parameter"
                )
                out.append(
                    Finding(
                        "unregistered-parameter",
                        "warning",
                        title,
                        unregistered_parameter_fix(qual, attr),
                        where=qual,
                    )
                )
        candidates = [
            (attr, val) for attr, val in candidates if not val.requires_grad or isinstance(val, nn.Parameter)
        ]
        home = _majority([str(t.device) for t in list(mod.parameters()) + list(mod.buffers())])
        if home is None:
            continue
        for attr, val in candidates:
            if str(val.device) != home:
                qual = f"{prefix}.{path}.{attr}" if path else f"{prefix}.{attr}"
                out.append(
                    Finding(
                        code="tensor-attribute",
                        severity="warning",
                        title=f"`{qual}` is a plain tensor attribute on {val.device} while its module is on "
                        f"{home}",
                        where=qual,
                        fix=(
                            f"`.to()` moves parameters and buffers only: register it in __init__ with "
                            f"`self.register_buffer('{attr}', tensor)`"
                        ),
                    )
                )
    return out


# ---------------------------------------------------------------------- batch


def _leaves(obj: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _leaves(v, f"{path}[{k!r}]")
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        for k in obj._fields:  # type: ignore[attr-defined]
            yield from _leaves(getattr(obj, k), f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{path}[{i}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _leaves(getattr(obj, f.name), f"{path}.{f.name}")


def audit_batch(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    target: Any = None,
    *,
    name: str = "model",
) -> list[Finding]:
    """Batch tensors (any nesting) not on the device of the first layer; a target not on the last layer's.

    Usage: ``audit_batch(model, (x,), {}, target=y)``.
    """
    findings: list[Finding] = []
    first = _first_layer(model, name)
    if first is not None:
        fpath, fmod, fdev = first
        stray = [
            (p, t)
            for p, t in list(_leaves(args, "args")) + list(_leaves(dict(kwargs), "kwargs"))
            if not is_cpu_scalar(t) and str(t.device) != fdev
        ]
        for path, t in stray:
            findings.append(
                Finding(
                    code="batch-device",
                    severity="error",
                    title=(
                        f"batch tensor {path} {tuple(t.shape)} {dtype_name(t)} is on {t.device} "
                        f"but the first layer `{fpath}` ({type(fmod).__name__}) is on {fdev}"
                    ),
                    where=path,
                    fix=(
                        f"move the batch before calling the model: `torchspan.to_device(batch, '{fdev}')` "
                        f"(or `x = x.to('{fdev}')`), or move the model: `{name}.to('{t.device}')`"
                    ),
                )
            )
    last = _last_layer(model, name)
    if target is not None and last is not None:
        lpath, lmod, ldev = last
        for path, t in _leaves(target, "target"):
            if not is_cpu_scalar(t) and str(t.device) != ldev:
                findings.append(
                    Finding(
                        code="target-device",
                        severity="error",
                        title=f"{path} {tuple(t.shape)} is on {t.device} but the model's output (last layer "
                        f"`{lpath}`) is on {ldev}",
                        where=path,
                        fix=f"move the target with `target = target.to('{ldev}')` before computing the loss",
                    )
                )
    return findings


# ---------------------------------------------------------------------- running


# PyTorch's own wordings of a device error (phrases, not single words: "on device" alone also
# matches unrelated messages such as "no space left on device").
_DEVICE_ERROR = re.compile(
    r"to be on the same device"
    r"|not (at|on) the same device"
    r"|on the same device as"
    r"|is not on the expected device"
    r"|expected device \S+ but got"
    r"|device type \w+ but got device type"
    r"|parameters and buffers on device"
    r"|expected type torch\.cuda"
    r"|Input type \(\S*cuda\S*\) and weight type|Input type \(\S+\) and weight type \(\S*cuda",
)


def looks_like_device_error(exc: BaseException) -> bool:
    """True for PyTorch errors about tensors on the wrong device.

    Usage: ``looks_like_device_error(RuntimeError("Expected all tensors to be on the same device..."))``.
    """
    return isinstance(exc, RuntimeError) and _DEVICE_ERROR.search(str(exc)) is not None


def _run(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    target: Any,
    loss_fn: Any,
    optimizer: Any,
    report: Report,
) -> None:
    grads = {id(p): (p, p.grad) for p in model.parameters()}
    if isinstance(loss_fn, nn.Module):
        grads.update({id(p): (p, p.grad) for p in loss_fn.parameters()})
    buffers = [(b, b.detach().clone()) for b in model.buffers() if not b.is_meta]
    named: dict[str, Any] = {"model": model}
    if isinstance(loss_fn, nn.Module):
        named["loss_fn"] = loss_fn
    if isinstance(optimizer, torch.optim.Optimizer):
        named["optimizer"] = optimizer
    w = watch(**named)
    try:
        with w:
            out = model(*args, **kwargs)
            if loss_fn is not None:
                loss = loss_fn(out, target) if target is not None else loss_fn(out)
                if isinstance(loss, torch.Tensor) and loss.requires_grad:
                    (loss if loss.dim() == 0 else loss.sum()).backward()
    except DeviceMismatchError as err:
        report.add(err.finding())
    except Exception as exc:  # the example run failed for another reason: report it, do not crash the audit
        device = looks_like_device_error(exc)
        report.add(
            Finding(
                code="run-device-error" if device else "run-failed",
                severity="error",
                title=f"the example {'forward/backward' if loss_fn is not None else 'forward'} failed: "
                f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
                fix=(
                    "see the static findings above for the tensor on the wrong device"
                    if device
                    else "check the example inputs match what the model's forward expects (shapes, dtypes, "
                    "arguments)"
                ),
            )
        )
    finally:
        with torch.no_grad():
            for p, g in grads.values():
                p.grad = g
            for b, saved in buffers:
                b.copy_(saved)
    report.ran = True
    report.ops_checked = w.ops
    report.merge(w.findings)


def doctor(
    model: nn.Module,
    *example_args: Any,
    target: Any = None,
    loss_fn: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    state_dict: Mapping[str, Any] | None = None,
    run: bool | None = None,
    **example_kwargs: Any,
) -> Report:
    """Audit ``model`` (and its loss, optimizer, batch, checkpoint) for device problems.

    Static checks (nothing runs): parameters/buffers of ``model`` and ``loss_fn`` grouped by
    device; batch tensors (any nesting) off the first layer's device; ``target`` off the last
    layer's; optimizer state off its parameter's device and param groups holding tensors that are
    no longer the model's parameters; ``nn.DataParallel`` without CUDA or with parameters off
    ``device_ids[0]``; ``state_dict`` keys with a ``module.`` prefix the model lacks (or the reverse).

    ``run`` (default: True when example inputs are given) then runs one forward — and a backward
    when ``loss_fn`` is given — under :func:`torchspan.watch`; gradients and buffers are restored.
    The names ``target``, ``loss_fn``, ``optimizer``, ``state_dict`` and ``run`` are reserved and
    cannot be forwarded to the model as keyword arguments.

    Usage::

        report = torchspan.doctor(model, x, target=y, loss_fn=nn.CrossEntropyLoss(weight=w))
        print(report)
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"doctor(model=...) got a {type(model).__name__}; pass the nn.Module to check")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"doctor(optimizer=...) got a {type(optimizer).__name__}; pass a torch.optim.Optimizer or None"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(
            f"doctor(loss_fn=...) got a non-callable {type(loss_fn).__name__}; pass e.g. "
            "nn.CrossEntropyLoss()"
        )
    if run is None:
        run = bool(example_args or example_kwargs)
    if run and not (example_args or example_kwargs):
        raise ValueError(
            "doctor(run=True) needs example inputs to run the model with: doctor(model, x, run=True)"
        )

    if run and target is not None and loss_fn is None:
        warnings.warn(
            "doctor(target=...) without loss_fn: the target's device is checked, but no loss and no "
            "backward run; pass loss_fn= (e.g. loss_fn=nn.CrossEntropyLoss()) to check the loss and the "
            "backward too",
            UserWarning,
            stacklevel=2,
        )
    report = Report()
    target_dev = None
    for _, t in _leaves(target, "target"):
        if not is_cpu_scalar(t):
            target_dev = str(t.device)
            break
    report.add(audit_modules(model, loss_fn, target_dev))
    report.add(audit_ties(model))
    report.add(audit_batch(model, example_args, example_kwargs, target))
    if optimizer is not None:
        report.add(audit_optimizer(optimizer, model, loss_fn))
    report.add(audit_dataparallel(model))
    if state_dict is not None:
        report.add(audit_state_dict(model, state_dict))
    if run:
        _run(model, example_args, example_kwargs, target, loss_fn, optimizer, report)
    return report
