"""``torchspan doctor SCRIPT.py [--json] [-- script args]``: run a training script under the device watcher.

torchspan's ``--json`` may come before or after SCRIPT; words after ``--`` all go to the script.

The script runs unmodified, as ``python SCRIPT.py args`` would run it (``__name__ == "__main__"``,
``sys.argv`` set, its folder first on ``sys.path``). At the first op whose tensors sit on different
devices the run stops and the report names the op, the module, every tensor and the fix.

Exit status: 0 when the script ran to the end with no device problem; 3 on a device error (or when
the script's objects have one, e.g. an optimizer built before ``.to()`` replaced the parameters); the
script's own status when it exits with ``sys.exit(n)``; 1 when it fails for another reason.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..diagnosis.audit import audit_modules, audit_optimizer, looks_like_device_error
from ..diagnosis.dataparallel import audit_dataparallel, audit_state_dict
from ..diagnosis.mismatch import DeviceMismatchError
from ..diagnosis.naming import find_in_frames, location, tb_frames, traceback_frames
from ..diagnosis.report import Finding, Report
from ..diagnosis.watcher import watch
from ._common import UsageError, console, print_json
from ._options import add_json_option

__all__ = ["register", "run", "run_script", "ScriptOutcome", "EXIT_DEVICE_ERROR"]

EXIT_DEVICE_ERROR = 3


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="run a training script and name the module, parameter and fix behind any device error",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_json_option(p, "the report", " (the script's own output goes to stderr)")
    p.add_argument("script", help="the Python script to run, e.g. train.py")
    p.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="arguments for the script (after an optional --)"
    )
    p.set_defaults(func=run)


@dataclass
class ScriptOutcome:
    """What happened when the script ran: ``status`` is ok, device-error, device-problem (ran to the end,
    but the audit of its objects found an error, e.g. an optimizer holding replaced parameters),
    script-error or script-exit."""

    status: str
    exit_code: int
    report: Report = field(default_factory=Report)
    modules_run: int = 0
    error: BaseException | None = None


def _script_traceback(exc: BaseException, script: str) -> str:
    tb = exc.__traceback__
    target = os.path.abspath(script)
    probe = tb
    while probe is not None and os.path.abspath(probe.tb_frame.f_code.co_filename) != target:
        probe = probe.tb_next
    return "".join(traceback.format_exception(type(exc), exc, probe or tb))


def _where(exc: BaseException) -> str | None:
    frames = traceback_frames(exc.__traceback__)
    if not frames:
        return None
    loc = location(frames[0])
    return f"{loc.short}: {loc.code}"


def _audit_objects(objects: dict[str, Any]) -> list[Finding]:
    """Static checks on the modules and optimizers a script left behind (by variable name)."""
    modules = {k: v for k, v in objects.items() if isinstance(v, nn.Module)}
    # keep top-level modules only: a submodule is reported through its root
    inner: set[int] = set()
    for m in modules.values():
        inner.update(id(s) for s in m.modules() if s is not m)
    roots = {k: m for k, m in modules.items() if id(m) not in inner}
    findings: list[Finding] = []
    for name, mod in roots.items():
        findings.extend(audit_modules(mod, names=(name, "loss_fn")))
        findings.extend(audit_dataparallel(mod, name=name))
    owned = {id(p) for m in roots.values() for p in m.parameters()}
    for oname, opt in objects.items():
        if not isinstance(opt, torch.optim.Optimizer) or not roots:
            continue
        ids = {id(p) for g in opt.param_groups for p in g["params"]}
        mname, mod = max(roots.items(), key=lambda kv: sum(id(p) in ids for p in kv[1].parameters()))
        # tensors no module of the script owns, shaped like parameters no optimizer holds: the optimizer
        # was built before `.to()` / `to_empty()` / `load_state_dict(assign=True)` replaced them
        mine = {id(p) for p in mod.parameters()}
        foreign = any(i in owned and i not in mine for i in ids)
        for f in audit_optimizer(opt, mod, names=(oname, mname)):
            if f.code == "optimizer-state-device" or (
                f.code == "optimizer-stale-params" and f.severity == "error" and not foreign
            ):
                findings.append(f)
    return findings


def _load_state_dict_findings(exc: BaseException) -> list[Finding]:
    """For a failed ``module.load_state_dict(sd)``: a ``module.`` / ``_orig_mod.`` prefix mismatch and its
    fix."""
    for frame in tb_frames(exc.__traceback__):
        if frame.f_code is not nn.Module.load_state_dict.__code__:
            continue
        module, sd = frame.f_locals.get("self"), frame.f_locals.get("state_dict")
        if not isinstance(module, nn.Module) or not isinstance(sd, Mapping):
            return []
        names = find_in_frames(traceback_frames(exc.__traceback__), (nn.Module, Mapping))
        name = next((k for k, v in names.items() if v is module), "model")
        keys = list(sd)  # load_state_dict works on a copy: find the user's dict by its keys
        sd_name = next(
            (k for k, v in names.items() if isinstance(v, Mapping) and v is not sd and list(v) == keys),
            "state_dict",
        )
        return audit_state_dict(module, sd, name=name, sd_name=sd_name)
    return []


def _require_script(script: str) -> None:
    """A regular file (a link to one counts): a folder, a device or a FIFO is named as what it is, before
    anything runs."""
    from ..files import require_regular_file

    try:
        require_regular_file(
            script, name="SCRIPT", what="a Python file", fix="give the path of a Python file, e.g. train.py"
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _check_compiles(script: str) -> None:
    """A script that is not Python (a syntax error, binary data) is a usage error, before anything runs."""
    try:
        with open(script, "rb") as fh:
            compile(fh.read(), script, "exec")
    except SyntaxError as exc:
        raise UsageError(
            f"SCRIPT {script!r} is not valid Python: {exc.msg} at line {exc.lineno}; fix the script or "
            "name another"
        ) from None
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"SCRIPT {script!r} cannot be read as Python ({exc}); give the path of a .py file"
        ) from None


def run_script(script: str, script_args: list[str], *, quiet_stdout: bool = False) -> ScriptOutcome:
    """Run ``script`` as ``__main__`` under :func:`torchspan.watch` and collect a report.

    Usage: ``outcome = run_script("train.py", ["--epochs", "1"])``; ``outcome.report``.
    """
    _require_script(script)
    _check_compiles(script)
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    w = watch()
    outcome = ScriptOutcome("ok", 0)
    leftovers: dict[str, Any] = {}
    redirect = contextlib.redirect_stdout(sys.stderr) if quiet_stdout else contextlib.nullcontext()
    try:
        with redirect, w:
            leftovers = runpy.run_path(script, run_name="__main__")
    except DeviceMismatchError as err:
        outcome = ScriptOutcome("device-error", EXIT_DEVICE_ERROR, error=err)
        outcome.report.add(err.finding())
        leftovers = find_in_frames(traceback_frames(err.__traceback__), (nn.Module, torch.optim.Optimizer))
    except SystemExit as exc:
        # what the script holds when it exits is audited as when it runs to its end
        leftovers = find_in_frames(traceback_frames(exc.__traceback__), (nn.Module, torch.optim.Optimizer))
        code = exc.code
        if code is None or code == 0:
            outcome = ScriptOutcome("ok", 0)
        else:
            if not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
            outcome = ScriptOutcome("script-exit", int(code), error=exc)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        leftovers = find_in_frames(traceback_frames(exc.__traceback__), (nn.Module, torch.optim.Optimizer))
        if looks_like_device_error(exc):
            outcome = ScriptOutcome("device-error", EXIT_DEVICE_ERROR, error=exc)
            where = _where(exc)
            outcome.report.add(
                Finding(
                    code="device-error",
                    severity="error",
                    title="PyTorch raised a device error outside any op the watcher sees: "
                    f"{str(exc).strip().splitlines()[0]}",
                    details=[f"code: {where}"] if where else [],
                    fix="see the findings below for the module, parameter or buffer on the wrong device",
                )
            )
        else:
            outcome = ScriptOutcome("script-error", 1, error=exc)
            sys.stderr.write(_script_traceback(exc, script))
            outcome.report.add(_load_state_dict_findings(exc))
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    report = outcome.report
    report.ran = True
    report.ops_checked = w.ops
    outcome.modules_run = w.modules_run
    objects = {
        k: v
        for k, v in leftovers.items()
        if isinstance(v, (nn.Module, torch.optim.Optimizer)) and not k.startswith("_")
    }
    report.merge(list(w.findings) + _audit_objects(objects))
    if outcome.status == "ok" and report.errors:
        outcome.status, outcome.exit_code = "device-problem", EXIT_DEVICE_ERROR
    return outcome


def _headline(outcome: ScriptOutcome, script: str) -> str:
    name = os.path.basename(script)
    stats = f"{outcome.report.ops_checked} ops and {outcome.modules_run} module calls checked"
    if outcome.status == "ok":
        return f"torchspan doctor: no device problem seen in {name} ({stats}, forward and backward)"
    if outcome.status == "device-error":
        return f"torchspan doctor: device error in {name} ({stats} before it)"
    if outcome.status == "device-problem":
        return (
            f"torchspan doctor: {name} ran to the end without a device error, but its objects have a "
            f"problem ({stats})"
        )
    if outcome.status == "script-exit":
        return (
            f"torchspan doctor: {name} exited with status {outcome.exit_code}; no device problem seen "
            f"before that ({stats})"
        )
    err = outcome.error
    return (
        f"torchspan doctor: {name} failed with {type(err).__name__}, which is not a device error "
        f"(traceback above); no device problem seen before it ({stats})"
    )


def _error_dict(err: BaseException | None) -> dict[str, Any] | None:
    """The exception that ended the script, for ``--json``: type, message and the script's line."""
    if err is None or (isinstance(err, SystemExit) and err.code in (None, 0)):
        return None
    return {"type": type(err).__name__, "message": str(err).strip(), "where": _where(err)}


def _own_options(args: argparse.Namespace) -> list[str]:
    """Take torchspan's own options (``--json``) from the words after SCRIPT that come before ``--``; the rest
    is the script's.

    ``torchspan doctor train.py --json -- --epochs 1``: JSON report, the script gets ``--epochs 1``;
    after ``--`` every word is the script's, ``--json`` included.
    """
    words = list(args.script_args)
    cut = words.index("--") if "--" in words else len(words)
    before, after = words[:cut], words[cut + 1 :]
    if "--json" in before:
        args.json = True
    return [w for w in before if w != "--json"] + after


def run(args: argparse.Namespace) -> int:
    script_args = _own_options(args)
    outcome = run_script(args.script, script_args, quiet_stdout=args.json)
    if args.json:
        print_json(
            {
                "script": args.script,
                "args": script_args,
                "status": outcome.status,
                "exit_code": outcome.exit_code,
                "modules_run": outcome.modules_run,
                "error": _error_dict(outcome.error),
                "report": outcome.report.to_dict(),
            }
        )
        return outcome.exit_code
    headline = _headline(outcome, args.script)
    if sys.stdout.isatty():
        from rich.text import Text

        con = console()
        con.print(Text(headline, style="bold red" if outcome.status == "device-error" else "bold green"))
        if outcome.report.findings:
            outcome.report.render(con)
    else:
        print(headline)
        for f in outcome.report.findings:
            print(f.format())
    return outcome.exit_code
