"""Auditing an optimizer against its model (``torchspan doctor``): param groups holding tensors the model no
longer owns (an optimizer built before the parameters were replaced), and state off its parameter's device.

Usage: ``for f in audit_optimizer(opt, model): print(f.title)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .mismatch import is_cpu_scalar
from .report import Finding, name_list

__all__ = ["audit_optimizer"]


def audit_optimizer(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    loss_fn: Any = None,
    *,
    names: tuple[str, str] = ("optimizer", "model"),
) -> list[Finding]:
    """Optimizer state off its parameter's device; param groups holding tensors the model no longer owns.

    Usage: ``audit_optimizer(opt, model)``.
    """
    known = {id(p) for p in model.parameters()}
    if isinstance(loss_fn, nn.Module):
        known |= {id(p) for p in loss_fn.parameters()}
    return _stale_params(optimizer, model, known, names) + _stray_state(optimizer, model, names)


def _stale_params(
    optimizer: torch.optim.Optimizer, model: nn.Module, known: set[int], names: tuple[str, str]
) -> list[Finding]:
    """Param groups holding tensors that are neither ``model``'s parameters nor the loss's (``known`` ids)."""
    oname, mname = names
    findings: list[Finding] = []
    in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
    orphans = [(n, p) for n, p in model.named_parameters() if id(p) not in in_opt]
    orphan_shapes = {tuple(p.shape) for _, p in orphans}
    for g, group in enumerate(optimizer.param_groups):
        stale = [(i, p) for i, p in enumerate(group["params"]) if id(p) not in known]
        if not stale:
            continue
        matched = [p for _, p in stale if tuple(p.shape) in orphan_shapes]
        listed = [f"params[{i}] {tuple(p.shape)} on {p.device}" for i, p in stale]
        details = [f"{len(stale)} of {len(group['params'])} tensors: {name_list(listed)}"]
        if orphans:
            details.append(
                f"{len(orphans)} parameter(s) of {mname} are in no param group: "
                f"{name_list([f'{mname}.{n}' for n, _ in orphans])}"
            )
        findings.append(
            Finding(
                code="optimizer-stale-params",
                severity="error" if matched else "warning",
                title=(
                    f"{oname}.param_groups[{g}] holds {len(stale)} tensor(s) that are not parameters of "
                    f"{mname}"
                    + (" - it was probably built before the parameters were replaced" if matched else "")
                ),
                where=f"{oname}.param_groups[{g}]",
                details=details,
                fix=(
                    f"build the optimizer after moving the model: `{mname}.to(device)` first, then "
                    f"`{oname} = torch.optim.{type(optimizer).__name__}({mname}.parameters(), ...)` "
                    f"(moving to or from 'meta', `to_empty()`, `load_state_dict(assign=True)` and "
                    f"`torch.__future__.set_overwrite_module_params_on_conversion(True)` create new "
                    f"Parameter objects)"
                    + (
                        ""
                        if matched
                        else "; ignore this if those tensors belong to another module on purpose"
                    )
                ),
            )
        )
    return findings


def _stray_state(optimizer: torch.optim.Optimizer, model: nn.Module, names: tuple[str, str]) -> list[Finding]:
    """Optimizer state tensors off their parameter's device (a CPU scalar such as Adam's ``step`` is fine)."""
    oname, mname = names
    findings: list[Finding] = []
    qual = {id(p): f"{mname}.{n}" for n, p in model.named_parameters()}
    stray: list[str] = []
    devices: set[str] = set()
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            pname = qual.get(id(p), f"param_groups[{g}]['params'][{i}]")
            for key, val in optimizer.state.get(p, {}).items():
                if isinstance(val, torch.Tensor) and not is_cpu_scalar(val) and val.device != p.device:
                    stray.append(f"{oname}.state[{pname}][{key!r}] on {val.device}, parameter on {p.device}")
                    devices.add(str(p.device))
    if stray:
        dev = sorted(devices)[0]
        findings.append(
            Finding(
                code="optimizer-state-device",
                severity="error",
                title=f"{len(stray)} optimizer state tensor(s) are not on their parameter's device",
                where=oname,
                details=[name_list(stray)],
                fix=(
                    f"move the state next to the parameters: `torchspan.to_device({oname}, '{dev}')`, or "
                    f"call `{mname}.to('{dev}')` before `{oname}.load_state_dict(...)` (it puts the state "
                    f"on each parameter's device at that moment)"
                ),
            )
        )
    return findings
