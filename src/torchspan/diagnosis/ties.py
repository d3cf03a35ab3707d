"""Broken ties: two parameters where the model had one (an input/output embedding pair, a shared weight).

A tie breaks when the shared ``nn.Parameter`` is replaced in one place only — a user's own
``.to()`` that makes new Parameters (to or from ``meta``, ``torch.__future__`` overwrite mode),
``head.weight = nn.Parameter(head.weight.to(dev))``, a checkpoint loaded with ``assign=True``.
Both halves then train separately and drift. Found two ways, without running the model: the model
declares the tie (``config.tie_word_embeddings`` with ``get_input_embeddings``/``get_output_embeddings``,
as transformers models do) but the two weights are different objects; or two distinct parameters
of one shape hold exactly the same non-constant values (what a broken copy looks like before the
first optimizer step).

Usage: ``findings = audit_ties(model)`` → ``[Finding(code="tie-broken", ...)]``.
"""

from __future__ import annotations

import torch
from torch import nn

from .report import Finding

__all__ = ["audit_ties"]

_FIX = (
    "re-tie them before training: `{b} = {a}` (the same nn.Parameter object; for transformers models "
    "`model.tie_weights()`), and move the model whole (`model.to(dev)`) or let torchspan.span place it"
)


def audit_ties(model: nn.Module, prefix: str = "model") -> list[Finding]:
    """Findings for ties the model declares or shows (equal values) that are two Parameters now."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    names = {id(p): n for n, p in model.named_parameters()}
    pairs: list[tuple[str, str, str]] = []
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False) and hasattr(model, "get_output_embeddings"):
        try:
            inp, out = model.get_input_embeddings(), model.get_output_embeddings()
        except (NotImplementedError, AttributeError):
            inp = out = None
        a, b = getattr(inp, "weight", None), getattr(out, "weight", None)
        if (
            isinstance(a, nn.Parameter)
            and isinstance(b, nn.Parameter)
            and a is not b
            and id(a) in names
            and id(b) in names
        ):
            pairs.append((names[id(a)], names[id(b)], "config.tie_word_embeddings is set"))
    by_shape: dict[tuple[tuple[int, ...], torch.dtype], list[tuple[str, nn.Parameter]]] = {}
    for n, p in model.named_parameters():
        if not p.is_meta and p.numel() > 1:
            by_shape.setdefault((tuple(p.shape), p.dtype), []).append((n, p))
    declared = {(a, b) for a, b, _ in pairs}
    for group in by_shape.values():
        for i, (na, a) in enumerate(group):
            da = a.detach().cpu()
            if bool((da == da.flatten()[0]).all()):
                continue  # constant (ones, zeros): equal by initialisation, not by a tie
            for nb, b in group[i + 1 :]:
                if (na, nb) not in declared and torch.equal(da, b.detach().cpu()):
                    pairs.append((na, nb, "they hold exactly the same values"))
    findings = []
    for a, b, why in pairs:
        pa, pb = model.get_parameter(a), model.get_parameter(b)
        where = f" ({pa.device} and {pb.device})" if pa.device != pb.device else ""
        findings.append(
            Finding(
                code="tie-broken",
                severity="error" if "config" in why else "warning",
                title=f"{prefix}.{a} and {prefix}.{b} look like one tied parameter split in two{where}: "
                f"{why}",
                where=f"{prefix}.{b}",
                fix=_FIX.format(a=f"{prefix}.{a}", b=f"{prefix}.{b}"),
            )
        )
    return findings
