"""Device layer: spec parsing, memory units and budgets, nested moves, error messages."""

from __future__ import annotations

import collections
import dataclasses
import time
import warnings
from typing import NamedTuple

import pytest
import torch
from torch import nn

import torchspan
from torchspan.hardware import (
    Device,
    devices,
    format_bytes,
    parse_memory,
    physical_index,
    resolve_device,
    to_device,
)

CUDA = torch.cuda.is_available()
needs_no_gpu = pytest.mark.skipif(CUDA, reason="checks the error for a machine without CUDA")
gpu = pytest.mark.gpu


# ----------------------------------------------------------------------------- memory units


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0", 0),
        ("1024", 1024),
        (2048, 2048),
        ("10B", 10),
        ("1KB", 1000),
        ("1KiB", 1024),
        ("1.5MB", 1_500_000),
        ("2MiB", 2 * 2**20),
        ("10GB", 10 * 10**9),
        ("10GiB", 10 * 2**30),
        ("10 gib", 10 * 2**30),
        ("1TB", 10**12),
        ("1TiB", 2**40),
        ("0.5GiB", 2**29),
    ],
)
def test_parse_memory_units(text: str | int, expected: int) -> None:
    assert parse_memory(text) == expected


@pytest.mark.parametrize("bad", ["-1", "-3GiB", -5, "ten GB", "10 XB", "", "GiB", True, [1]])
def test_parse_memory_rejects_with_name_and_value(bad: object) -> None:
    with pytest.raises(ValueError) as exc:
        parse_memory(bad, name="memory['cpu']")  # type: ignore[arg-type]
    msg = str(exc.value)
    assert "memory['cpu']" in msg
    assert repr(bad) in msg


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(None) == "-"


# ----------------------------------------------------------------------------- specs


def test_auto_ends_with_cpu_and_describes_it() -> None:
    found = devices()
    assert found[-1].kind == "cpu"
    cpu = found[-1]
    assert cpu.total_memory and cpu.total_memory > 0
    assert cpu.free_memory is not None and 0 < cpu.free_memory <= cpu.total_memory
    assert cpu.name and cpu.present and cpu.budget is None
    assert cpu.capacity == cpu.free_memory


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("cpu", ["cpu"]),
        ("cpu,cpu", ["cpu", "cpu"]),
        ("cpu*3", ["cpu", "cpu", "cpu"]),
        (["cpu", "cpu"], ["cpu", "cpu"]),
        ([torch.device("cpu")], ["cpu"]),
        ("meta", ["meta"]),
        (" cpu , meta ", ["cpu", "meta"]),
    ],
)
def test_specs(spec: object, expected: list[str]) -> None:
    assert [str(d) for d in devices(spec)] == expected  # type: ignore[arg-type]


def test_device_objects_pass_through_as_copies() -> None:
    d = devices("cpu")[0]
    again = devices([d], memory={"cpu": "1GiB"})[0]
    assert again.budget == 2**30 and d.budget is None


@pytest.mark.parametrize("bad", ["", "cpu,,cpu", "nvidia", "1", [], "cpu*0"])
def test_bad_specs_are_value_errors(bad: object) -> None:
    with pytest.raises(ValueError) as exc:
        devices(bad)  # type: ignore[arg-type]
    assert "devices" in str(exc.value) or "cpu" in str(exc.value)


@needs_no_gpu
@pytest.mark.parametrize(
    "spec", ["cuda", "cuda:0", "cuda:0,1", "cuda:0,cpu", 0, [0, 1], torch.device("cuda", 3)]
)
def test_missing_cuda_says_what_is_visible(spec: object) -> None:
    with pytest.raises(ValueError) as exc:
        devices(spec)  # type: ignore[arg-type]
    msg = str(exc.value)
    assert "Visible devices: cpu" in msg
    assert "'cpu'" in msg  # how to select what is there


def test_missing_gpu_index_names_the_visible_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchspan.hardware.inventory as hw

    monkeypatch.setattr(hw, "_cuda_count", lambda: 2)
    with pytest.raises(ValueError) as exc:
        resolve_device("cuda:3")
    msg = str(exc.value)
    assert "'cuda:3' does not exist" in msg
    assert "2 CUDA device(s) are visible (cuda:0, cuda:1)" in msg
    assert "CUDA_VISIBLE_DEVICES" in msg


def test_unknown_device_type() -> None:
    with pytest.raises(ValueError, match="not a device spec|unknown device"):
        resolve_device("tpu:0")
    with pytest.raises(ValueError, match="not a device"):
        resolve_device(1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "env, logical, physical",
    [
        ({}, 1, "1"),
        ({"CUDA_VISIBLE_DEVICES": "2,3"}, 0, "2"),
        ({"CUDA_VISIBLE_DEVICES": "2,3"}, 1, "3"),
        ({"CUDA_VISIBLE_DEVICES": "GPU-abc,GPU-def"}, 1, "GPU-def"),
        ({"CUDA_VISIBLE_DEVICES": "1,x,0"}, 1, "?"),  # CUDA stops at the first invalid entry
    ],
)
def test_physical_index(env: dict[str, str], logical: int, physical: str) -> None:
    assert physical_index(logical, env) == physical


# ----------------------------------------------------------------------------- budgets


def test_budgets_are_parsed_per_device() -> None:
    found = devices("cpu,meta", memory={"cpu": "2GiB", "meta": 1000})
    assert found[0].budget == 2 * 2**30 and found[0].capacity == 2 * 2**30
    assert found[1].budget == 1000


def test_budget_for_unlisted_device_names_key_and_value() -> None:
    with pytest.raises(ValueError) as exc:
        devices("cpu", memory={"cuda:0": "10GiB"})
    msg = str(exc.value)
    assert "memory['cuda:0']='10GiB'" in msg and "not in the device list (cpu)" in msg


def test_negative_budget_names_key() -> None:
    with pytest.raises(ValueError, match=r"memory\['cpu'\]='-1GB' is negative"):
        devices("cpu", memory={"cpu": "-1GB"})


def test_unparseable_budget_names_key() -> None:
    with pytest.raises(ValueError, match=r"memory\['cpu'\]='lots'"):
        devices("cpu", memory={"cpu": "lots"})


def test_budget_above_capacity_warns() -> None:
    with pytest.warns(UserWarning, match="above cpu's capacity"):
        devices("cpu", memory={"cpu": "1000TiB"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        devices("cpu", memory={"cpu": "1GiB"})


# ----------------------------------------------------------------------------- to_device


class Pair(NamedTuple):
    a: torch.Tensor
    b: list


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    meta: dict
    label: str = "train"


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor


def test_nested_structures_round_trip_through_meta() -> None:
    x, y, z = torch.randn(2, 3), torch.arange(4), torch.ones(1)
    batch = {
        "pair": Pair(x, [y, (z, "keep", 3)]),
        "dc": Batch(x, {"k": y}),
        "frozen": Frozen(z),
        "od": collections.OrderedDict(w=x),
        "dd": collections.defaultdict(list, {"v": [y]}),
        "none": None,
    }
    moved = to_device(batch, "meta")
    assert isinstance(moved["pair"], Pair) and moved["pair"].a.is_meta
    assert moved["pair"].b[0].is_meta and moved["pair"].b[1][0].is_meta
    assert moved["pair"].b[1][1:] == ("keep", 3)
    assert isinstance(moved["dc"], Batch) and moved["dc"].x.is_meta and moved["dc"].meta["k"].is_meta
    assert moved["dc"].label == "train"
    assert isinstance(moved["frozen"], Frozen) and moved["frozen"].x.is_meta
    assert isinstance(moved["od"], collections.OrderedDict) and moved["od"]["w"].is_meta
    assert isinstance(moved["dd"], collections.defaultdict) and moved["dd"]["v"][0].is_meta
    assert moved["dd"].default_factory is list
    assert moved["none"] is None
    # originals untouched, shapes and dtypes kept
    assert x.device.type == "cpu" and batch["dc"].x is x
    assert moved["pair"].b[0].dtype == torch.int64 and moved["pair"].a.shape == (2, 3)
    # back to the same device is a no-op that keeps identity
    same = to_device(batch, "cpu")
    assert same["pair"].a is x


def test_module_moves_parameters_and_buffers() -> None:
    criterion = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0]))
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    assert to_device(criterion, "meta") is criterion
    assert criterion.weight.is_meta  # the classic miss: a loss's class-weight buffer
    to_device(model, "meta")
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())


def test_meta_module_cannot_move_to_real_device() -> None:
    model = nn.Linear(2, 2, device="meta")
    with pytest.raises(ValueError, match="to_empty"):
        to_device(model, "cpu")
    with pytest.raises(ValueError, match="to_empty"):
        to_device(torch.empty(3, device="meta"), "cpu")


def test_optimizer_state_moves_but_adam_step_stays_on_host() -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    to_device(model, "meta")
    assert to_device(opt, "meta") is opt
    for state in opt.state.values():
        assert state["exp_avg"].is_meta and state["exp_avg_sq"].is_meta
        assert state["step"].device.type == "cpu"  # PyTorch keeps non-capturable step counters on the host


def test_non_tensors_unchanged() -> None:
    obj = object()
    assert to_device(obj, "meta") is obj
    assert to_device("text", "meta") == "text"
    assert to_device(3.5, "meta") == 3.5


@needs_no_gpu
def test_to_device_missing_gpu_is_value_error() -> None:
    with pytest.raises(ValueError, match="Visible devices: cpu"):
        to_device(torch.ones(1), "cuda")


def test_described_device_cannot_be_moved_to() -> None:
    ghost = Device(
        torch.device("cuda", 0), "A100-40GB", total_memory=40 * 2**30, source="catalog: NVIDIA datasheet"
    )
    with pytest.raises(ValueError, match="described, not present"):
        to_device(torch.ones(1), ghost)


def test_public_names() -> None:
    assert torchspan.devices is devices
    assert torchspan.to_device is to_device
    assert torchspan.Device is Device
    assert "devices" in torchspan.__all__
    with pytest.raises(AttributeError):
        torchspan.not_a_name  # noqa: B018


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_devices_and_moves() -> None:  # pragma: no cover - runs on GPU machines
    found = devices("cuda")
    assert all(d.kind == "cuda" and d.total_memory for d in found)
    batch = to_device({"x": torch.ones(2)}, "cuda")
    assert batch["x"].is_cuda
    crit = to_device(nn.CrossEntropyLoss(weight=torch.ones(3)), "cuda:0")
    assert crit.weight.is_cuda


def test_budget_keys_name_devices_as_the_device_list_prints_them() -> None:
    from torchspan.hardware import budget_key

    assert budget_key("cuda") == "cuda:0"
    assert budget_key(1) == "cuda:1"
    assert budget_key(" CPU ") == "cpu"
    assert budget_key(torch.device("cuda", 2)) == "cuda:2"
    assert [str(d.device) for d in devices("cpu", memory={" CPU ": "1KiB"})] == [budget_key(" CPU ")]


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ("1e999GiB", "is infinite"),
        (float("inf"), "is infinite"),
        (float("nan"), "is not a number"),
        ("1e25GiB", "over 1 EiB"),
        (2**70, "over 1 EiB"),
    ],
)
def test_non_finite_and_absurd_budgets_are_value_errors(bad: object, needle: str) -> None:
    # issue 10: these were OverflowError / "cannot convert float NaN to integer" tracebacks
    with pytest.raises(ValueError, match=needle) as exc:
        devices("cpu", memory={"cpu": bad})  # type: ignore[dict-item]
    assert "memory['cpu']" in str(exc.value) and "'80GiB'" in str(exc.value)


@pytest.mark.parametrize("spec", ["a100-80gb*300", "a100-80gb*1000000", "cpu*100,a100-40gb*29"])
def test_device_count_is_bounded_before_expanding(spec: str) -> None:
    # issue 10: indices wrapped past 127 (cuda:-128) and a million repeats hung
    start = time.perf_counter()
    with pytest.raises(ValueError, match="at most 128"):
        devices(spec)
    assert time.perf_counter() - start < 2.0
    last = devices("a100-80gb*128")[-1]
    assert str(last.device) == "cuda:127"


def test_to_device_refuses_to_pretend_it_moved_a_generator() -> None:
    # issue 10: the generator came back unmoved without a word
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(
        ValueError,
        match=r"torch.Generator on cpu, which cannot move to meta.*torch.Generator\(device='meta'\)",
    ):
        to_device({"x": torch.ones(2), "gen": gen}, "meta")
    assert to_device({"gen": gen}, "cpu")["gen"] is gen  # already there: kept
