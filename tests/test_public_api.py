"""The public surface: a handful of names, none shadowed by a submodule of the same name."""

from __future__ import annotations

import importlib
import pkgutil

import torchspan


def _packages() -> list[str]:
    return ["torchspan"] + [
        m.name for m in pkgutil.walk_packages(torchspan.__path__, "torchspan.") if m.ispkg
    ]


def test_no_submodule_is_named_like_an_exported_name() -> None:
    # `import torchspan.x.y` binds `y` on the package; if `y` is also an exported function, the
    # function silently becomes a module for everyone who imported the submodule first.
    for pkg in _packages():
        mod = importlib.import_module(pkg)
        subs = {m.name for m in pkgutil.iter_modules(mod.__path__)}
        assert not subs & set(getattr(mod, "__all__", [])), pkg


def test_public_functions_stay_functions_after_every_submodule_is_imported() -> None:
    for info in pkgutil.walk_packages(torchspan.__path__, "torchspan."):
        if not info.name.endswith("__main__"):  # that one runs the CLI
            importlib.import_module(info.name)
    for name in (
        "devices",
        "to_device",
        "doctor",
        "watch",
        "span",
        "profile",
        "plan",
        "init_distributed",
        "shard_batch",
        "rank_batches",
        "save_checkpoint",
        "load_checkpoint",
    ):
        assert callable(getattr(torchspan, name)) and not isinstance(
            getattr(torchspan, name), type(torchspan)
        ), name
    for name in (
        "Device",
        "Report",
        "DeviceMismatchError",
        "Spanned",
        "NoSplit",
        "Profile",
        "Plan",
        "PlanError",
    ):
        assert isinstance(getattr(torchspan, name), type), name
    assert issubclass(torchspan.DeviceMismatchError, RuntimeError)
    assert issubclass(torchspan.PlanError, ValueError)
    assert set(torchspan.__all__) >= {"devices", "doctor", "span", "plan", "profile", "__version__"}
