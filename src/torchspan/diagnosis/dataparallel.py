"""``nn.DataParallel`` and its traces: checks shared by the audit (static) and the watcher (running).

Without CUDA, ``DataParallel`` silently just calls the wrapped module (a warning); with CUDA it
needs every parameter and buffer on ``device_ids[0]`` before its forward (an error naming them).
A state dict saved from a wrapper carries a ``module.`` prefix (``_orig_mod.`` for
``torch.compile``) the plain model lacks, or the reverse.

Usage: ``findings = audit_dataparallel(model) + audit_state_dict(model, torch.load(path))``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .mismatch import DeviceMismatchError, dtype_name, py_path
from .naming import Namer, named_tensors
from .report import Finding, TensorArg, name_list

__all__ = [
    "dataparallel_inert_finding",
    "dataparallel_device_error",
    "stray_tensors",
    "audit_dataparallel",
    "audit_state_dict",
    "WRAPPER_PREFIXES",
]

WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def dataparallel_inert_finding(path: str) -> Finding:
    """The warning for an ``nn.DataParallel`` on a machine (or model) without CUDA."""
    code_path = py_path(path)
    return Finding(
        code="dataparallel-no-cuda",
        severity="warning",
        title=f"nn.DataParallel at `{path}` does nothing here: no CUDA device is available",
        where=path,
        details=[
            "Without CUDA, DataParallel just calls the wrapped module; on a machine with GPUs the same "
            "code copies the inputs to cuda:0 and fails unless every parameter is already on cuda:0.",
            "Its state_dict keys also gain a 'module.' prefix that a plain model does not have.",
        ],
        fix=(
            f"in CPU mode drop the wrapper: `{code_path} = {code_path}.module` (or wrap only when "
            "`torch.cuda.device_count() > 1`, after `model.to('cuda:0')`)"
        ),
    )


def stray_tensors(dp: nn.DataParallel) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers of the wrapped module that are not on ``device_ids[0]``."""
    src = dp.src_device_obj
    return [
        (n, t)
        for n, t in list(dp.module.named_parameters()) + list(dp.module.named_buffers())
        if t.device != src
    ]


def dataparallel_device_error(
    dp: nn.DataParallel, stray: list[tuple[str, torch.Tensor]], namer: Namer
) -> DeviceMismatchError:
    """The error for a ``DataParallel`` forward whose wrapped module has ``stray`` tensors off
    ``device_ids[0]``."""
    src = dp.src_device_obj
    path = py_path(namer.module_path(dp))
    args: list[TensorArg] = []
    for n, t in stray[:4]:
        named = namer.tensor(t)
        kind, name = named if named else ("parameter", f"{path}.module.{n}")
        args.append(TensorArg(n, str(t.device), tuple(t.shape), dtype_name(t), kind, name, odd=True))
    more = f" (and {len(stray) - 4} more)" if len(stray) > 4 else ""
    first = args[0].name
    return DeviceMismatchError(
        op="nn.DataParallel.forward",
        phase="forward",
        module=namer.module_label(dp),
        tensors=args,
        expected=str(src),
        headline=(
            f"nn.DataParallel needs every parameter and buffer of the wrapped module on {src} "
            f"(device_ids[0]) before its forward, but {first} is on {args[0].device}{more}"
        ),
        fix=(
            f"move the model before wrapping it: `{path}.module.to('{src}')` (or build it with "
            f"`model.to('{src}')` first, then `nn.DataParallel(model)`); in CPU mode drop the wrapper: "
            f"`{path} = {path}.module`"
        ),
        location=namer.location,
        code="dataparallel-device",
    )


def audit_dataparallel(model: nn.Module, *, name: str = "model") -> list[Finding]:
    """``nn.DataParallel`` without CUDA, or whose wrapped parameters are not on ``device_ids[0]``.

    Usage: ``audit_dataparallel(model)``.
    """
    findings: list[Finding] = []
    for path, mod in model.named_modules():
        if not isinstance(mod, nn.DataParallel):
            continue
        qual = f"{name}.{path}" if path else name
        if not mod.device_ids:
            findings.append(dataparallel_inert_finding(qual))
            continue
        src = mod.src_device_obj
        stray = [(k, q, t) for k, q, t in named_tensors(mod.module, f"{qual}.module") if t.device != src]
        if stray:
            kind, first, t = stray[0]
            findings.append(
                Finding(
                    code="dataparallel-device",
                    severity="error",
                    title=(
                        f"nn.DataParallel `{qual}` needs the wrapped module on {src} (device_ids[0]), but "
                        f"{kind} `{first}` is on {t.device}"
                        + (f" (and {len(stray) - 1} more)" if len(stray) > 1 else "")
                    ),
                    where=qual,
                    details=[name_list([f"{q} on {x.device}" for _, q, x in stray])],
                    fix=(
                        f"call `{qual}.module.to('{src}')` before the first forward (or "
                        f"`model.to('{src}')` before wrapping); in CPU mode remove the wrapper: `{qual} = "
                        f"{qual}.module`"
                    ),
                )
            )
    return findings


def audit_state_dict(
    model: nn.Module, state_dict: Mapping[str, Any], *, name: str = "model", sd_name: str = "state_dict"
) -> list[Finding]:
    """Keys with a ``module.`` (or ``_orig_mod.``) prefix the model lacks, and the reverse.

    ``name`` and ``sd_name`` are the variable names used in the fix.

    Usage: ``audit_state_dict(model, torch.load("ckpt.pt"))``.
    """
    if not isinstance(state_dict, Mapping):
        raise ValueError(
            f"state_dict={type(state_dict).__name__} is not a mapping of names to tensors; pass "
            f"`torch.load(path)` (or its ['model'] entry if the checkpoint bundles several things)"
        )
    findings: list[Finding] = []
    sd_keys = set(state_dict)
    model_keys = set(model.state_dict())
    if not sd_keys or sd_keys == model_keys:
        return findings
    for prefix in WRAPPER_PREFIXES:
        if all(k.startswith(prefix) for k in sd_keys) and not all(k.startswith(prefix) for k in model_keys):
            stripped = {k[len(prefix) :] for k in sd_keys}
            if len(stripped & model_keys) >= max(1, len(stripped) // 2):
                example = sorted(sd_keys)[0]
                findings.append(
                    Finding(
                        code="state-dict-prefix",
                        severity="error",
                        title=(
                            f"state dict keys carry a '{prefix}' prefix (e.g. {example!r}) that {name}'s "
                            "keys lack"
                            + (
                                " - it was saved from nn.DataParallel / DistributedDataParallel"
                                if prefix == "module."
                                else " - it was saved from a torch.compile'd model"
                            )
                        ),
                        where="state_dict",
                        details=[
                            f"{len(stripped & model_keys)} of {len(sd_keys)} keys match once the prefix is "
                            "removed"
                        ],
                        fix=(
                            f"strip it before loading: "
                            f"`torch.nn.modules.utils.consume_prefix_in_state_dict_if_present({sd_name}, "
                            f"'{prefix}')`, then `{name}.load_state_dict({sd_name})`; next time save the "
                            f"unwrapped model: `.{prefix.rstrip('.')}.state_dict()` of the wrapper"
                        ),
                    )
                )
                return findings
        if all(k.startswith(prefix) for k in model_keys) and not any(k.startswith(prefix) for k in sd_keys):
            added = {prefix + k for k in sd_keys}
            if len(added & model_keys) >= max(1, len(added) // 2):
                findings.append(
                    Finding(
                        code="state-dict-prefix",
                        severity="error",
                        title=f"{name} is wrapped (its keys start with '{prefix}') but the state dict's keys "
                        "do not",
                        where="state_dict",
                        details=[
                            f"{len(added & model_keys)} of {len(sd_keys)} keys match once the prefix is added"
                        ],
                        fix="load into the wrapped module: "
                        f"`{name}.{prefix.rstrip('.')}.load_state_dict({sd_name})`",
                    )
                )
                return findings
    return findings
