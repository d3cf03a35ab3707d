"""Every piece of advice in an error names something that exists (issue 29).

The texts are every string literal in ``src/torchspan`` as Python builds it (adjacent literals joined, an
f-string's holes as ``{}``), so a message split over lines reads whole. They recommend keyword options two
ways:

- **a call**: ``span(model, shard=True, offload='cpu')``, ``span(..., weights='init')``,
  ``train_step(inputs, target=None, loss_fn=...)``: the public function it names (``PUBLIC``) must accept
  every keyword written at the call's top level;
- **"pass NAME=..."** (``pass per_shard_batchnorm=True``, ``pass rank= and world_size= explicitly``): the
function
  the sentence names ("pass loss_reduction='mean' to train_step"), else the functions ``ADVISED`` says the
  error reaches its user through (the module's message is theirs); a "pass NAME=" found nowhere in ``ADVISED``
  fails: say which function it advises.

"Accepts" is ``inspect.signature``: a parameter of that name (not positional-only) or ``**kwargs``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torchspan
from torchspan.layers import find_layers
from torchspan.parity import check_parity
from torchspan.parity_ranks import compare_strategies
from torchspan.runtime.ranks import DataParallelReplica

SOURCE = Path(torchspan.__file__).parent

# the public callables advice may name, by the name a message calls them
PUBLIC: dict[str, Callable[..., Any]] = {
    **{
        name: getattr(torchspan, name)
        for name in (
            "span",
            "plan",
            "profile",
            "doctor",
            "watch",
            "devices",
            "to_device",
            "shard_batch",
            "rank_batches",
            "init_distributed",
            "save_checkpoint",
            "load_checkpoint",
            "export_safetensors",
            "Plan",
        )
    },
    "train_step": torchspan.Spanned.train_step,
    "clip_grad_norm_": torchspan.Spanned.clip_grad_norm_,
    "DataParallelReplica": DataParallelReplica,
    "compare_strategies": compare_strategies,
    "check_parity": check_parity,
    "find_layers": find_layers,
}

# "pass NAME=" that names no function: (module under src/torchspan, NAME) -> the functions whose callers get
# it (a PUBLIC name, or another library's "module.Callable", checked where that library is installed)
ADVISED: dict[tuple[str, str], tuple[str, ...]] = {
    ("diagnosis/audit.py", "loss_fn"): ("doctor",),
    ("layers/blocks.py", "no_split"): ("span", "find_layers"),
    ("parity_ranks.py", "build"): ("compare_strategies",),
    ("planner/api.py", "recompute"): (
        "span",
        "plan",
    ),  # recompute_alias: checkpoint= is recompute='s old name in both
    ("planner/strategies.py", "host_memory"): ("plan",),
    ("planner/topology.py", "intra_link"): ("plan",),
    ("planner/topology.py", "interconnect"): ("plan",),
    ("runtime/lossweights.py", "loss_reduction"): ("train_step",),
    ("runtime/modelloss.py", "loss_fn"): ("train_step",),
    ("runtime/ranks/replicachecks.py", "scaler"): ("DataParallelReplica",),  # span makes its own scaler
    ("runtime/ranks/replicachecks.py", "per_shard_batchnorm"): (
        "span",
        "DataParallelReplica",
    ),  # span(shard=True), launched span
    ("runtime/ranks/env.py", "rank"): (
        "shard_batch",
        "rank_batches",
    ),  # said only to them (join_launched_job(explicit=True))
    ("runtime/ranks/env.py", "world_size"): ("shard_batch", "rank_batches"),
    ("runtime/ranks/metaweights.py", "weights"): ("span", "DataParallelReplica"),
    ("runtime/choose.py", "devices"): ("span",),  # own forward, interleaved-1f1b on stages not looped
    ("runtime/local/looped.py", "devices"): ("span",),  # interleaved-1f1b on stages that are not looped
    ("runtime/ranks/looped.py", "balance"): ("span",),  # more stages than ranks, not a multiple
    ("runtime/ranks/ownlooped.py", "balance"): ("span",),  # own forward, several stages per rank: refusals
    ("runtime/ranks/ownlooped.py", "schedule"): ("span",),
    ("runtime/ranks/ownlooped.py", "recompute"): ("span",),
    ("runtime/ranks/owninterleaved.py", "schedule"): ("span",),  # a new path in an interleaved step
    ("schedule.py", "balance"): ("span",),  # interleaved-1f1b: stages not a multiple of the ranks
    ("runtime/ranks/checkpointio.py", "strict"): ("load_checkpoint",),
    ("lightning/core.py", "devices"): ("lightning.Trainer",),  # Lightning's own process count
    ("hf.py", "span"): ("torchspan.hf.Trainer",),
    ("hf.py", "train_dataset"): ("torchspan.hf.Trainer",),
    ("runtime/ranks/tensorparallel.py", "shard"): ("span",),
    ("runtime/ranks/tensorparallel.py", "tp_plan"): ("span",),
    ("runtime/ranks/tpstages.py", "balance"): (
        "span",
    ),  # a pipeline of tensor-parallel stages: pp x tp must divide
}

_CALL = re.compile(r"([A-Za-z_][\w.]*)\(")
_PASS = re.compile(
    r"\bpass\s+(?=[A-Za-z_]\w*=)", re.IGNORECASE
)  # "pass NAME=", not "pass the model (model=...)"
_KEYWORD = re.compile(r"(?:^|[\s,(\[])([A-Za-z_]\w*)=(?!=)")


def _texts(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Every string as the program builds it: an f-string whole (its holes ``{}``), other literals as they
    are."""
    parts = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts.update(id(v) for v in node.values)
            yield node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in parts:
            yield node.lineno, node.value


def _top_level(text: str, start: int, stop_at_close: bool) -> tuple[str, int]:
    """``text`` from ``start`` with everything inside brackets blanked, up to the bracket that closes (a
    call's arguments) or the end; and where it stopped."""
    depth, out, i = 0, [], start
    while i < len(text):
        c = text[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0 and stop_at_close:
                break
            depth = max(0, depth - 1)
        out.append(c if depth == 0 or c in "([{" and depth == 1 else " ")
        i += 1
    return "".join(out), i


def _keywords(text: str) -> list[str]:
    return list(dict.fromkeys(_KEYWORD.findall(text)))


def _calls(text: str) -> Iterator[tuple[str, list[str]]]:
    """``(function, keywords)`` for each call of a public function written in ``text``."""
    for m in _CALL.finditer(text):
        name = m.group(1).rsplit(".", 1)[-1]
        if name in PUBLIC:
            args, _ = _top_level(text, m.end(), stop_at_close=True)
            yield name, _keywords(args)


def _passes(text: str) -> Iterator[tuple[str | None, list[str]]]:
    """``(function or None, keywords)`` for each "pass NAME=..." clause: up to a ';', ', or ', '. ' or ' to ';
    the function is the public one right after ' to ', if any."""
    for m in _PASS.finditer(text):
        rest, _ = _top_level(text, m.end(), stop_at_close=False)
        cut = min(
            (i for i in (rest.find(s) for s in (";", ", or ", ". ", " to ")) if i >= 0), default=len(rest)
        )
        to = re.match(r" to ([A-Za-z_]\w*)\b", rest[cut:])
        names = _keywords(rest[:cut])
        if names:
            yield (to.group(1) if to and to.group(1) in PUBLIC else None), names


def _resolve(name: str) -> Callable[..., Any] | None:
    """A ``PUBLIC`` name, or another library's ``module.Callable`` (``None`` where that library is not
    installed)."""
    if name in PUBLIC:
        return PUBLIC[name]
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError:
        return None


def _accepts(fn: Callable[..., Any], keyword: str) -> bool:
    params = inspect.signature(fn).parameters.values()
    return any(p.kind is p.VAR_KEYWORD for p in params) or any(
        p.name == keyword and p.kind is not p.POSITIONAL_ONLY for p in params
    )


def _advice() -> Iterator[tuple[str, int, str, str | None, str]]:
    """``(module, line, the text, function or None, keyword)`` for every piece of keyword advice in the
    package."""
    for path in sorted(SOURCE.rglob("*.py")):
        module = path.relative_to(SOURCE).as_posix()
        for line, text in _texts(ast.parse(path.read_text(encoding="utf-8"))):
            for function, names in [*_calls(text), *_passes(text)]:
                for name in names:
                    yield module, line, text, function, name


def test_the_scanner_reads_advice_as_written() -> None:
    text = (
        "or pass per_shard_batchnorm=True to accept it; use span(model, shard=True, offload='cpu', "
        "devices=[f(x=1)])"
    )
    assert list(_passes(text)) == [(None, ["per_shard_batchnorm"])]
    assert list(_calls(text)) == [("span", ["shard", "offload", "devices"])]
    assert list(_passes("Pass loss_reduction='mean' or 'sum' to train_step, or loss_normalizer=f")) == [
        ("train_step", ["loss_reduction"])
    ]
    assert list(_passes("pass loss_fn= (e.g. loss_fn=nn.CrossEntropyLoss(weight=w)) to check")) == [
        (None, ["loss_fn"])
    ]
    assert list(_passes("the bypass x=1 passes y=2")) == []
    assert list(_passes("pass the plain model (model=...), and span= says how to span it")) == []
    joined = dict(_texts(ast.parse('x = ("pass a" "lpha=1")\ny = f"pass {b}=2, or pass beta={c}"')))
    assert joined == {1: "pass alpha=1", 2: "pass {}=2, or pass beta={}"}


def test_every_keyword_an_error_recommends_is_accepted() -> None:
    wrong, unclassified, found = [], [], set()
    for module, line, text, function, name in _advice():
        if function is not None:
            targets: tuple[str, ...] = (function,)
        else:
            found.add((module, name))
            if (module, name) not in ADVISED:
                unclassified.append(f"{module}:{line}: pass {name}= ({text[:120]!r})")
                continue
            targets = ADVISED[(module, name)]
        for target in targets:
            fn = _resolve(target)
            if fn is not None and not _accepts(fn, name):
                wrong.append(
                    f"{module}:{line}: advises {target}(..., {name}=...), which {target} does not take: "
                    f"{text[:160]!r}"
                )
    assert not wrong, "advice naming an option that does not exist:\n" + "\n".join(wrong)
    assert not unclassified, "say in ADVISED which function each of these advises:\n" + "\n".join(
        unclassified
    )
    stale = sorted(
        k for k in set(ADVISED) - found if (SOURCE / k[0]).exists()
    )  # a module not here (yet) is no evidence
    assert not stale, f"ADVISED lists advice no error gives any more: {stale}"


def test_the_advice_checked_is_not_nothing() -> None:
    advice = {(function, name) for _, _, _, function, name in _advice()}
    assert {
        ("span", "weights"),
        ("span", "shard"),
        ("train_step", "loss_reduction"),
        (None, "per_shard_batchnorm"),
    } <= advice
