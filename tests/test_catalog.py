"""Catalog of described devices: lookups, figures, numbering through ``torchspan.devices``."""

from __future__ import annotations

import pytest
import torch

import torchspan
from torchspan.hardware import catalog


def test_every_entry_is_described_with_sources_and_figures() -> None:
    assert {
        "h100-80gb",
        "a100-40gb",
        "a100-80gb",
        "v100-16gb",
        "v100-32gb",
        "l4",
        "t4",
        "rtx-4090",
        "generic-cpu",
    } <= set(catalog.names())
    for key in catalog.names():
        dev = catalog.lookup(key)
        assert dev is not None
        assert not dev.present
        assert dev.source.startswith("described: ") and len(dev.source) > 20
        assert dev.total_memory and dev.total_memory >= 16 * 2**30
        assert dev.peak_flops and dev.peak_flops > 1e12
        assert dev.host_bandwidth and dev.host_bandwidth >= 16e9
        assert dev.extra["memory_bandwidth"] > 50e9
        assert "FP32" in dev.extra["peak_flops_precision"]
        assert set(dev.extra["flops"]) == {"fp32", "tf32", "bf16", "fp16"}
        assert dev.extra["host_link"].startswith("PCIe Gen")


def test_known_datasheet_figures() -> None:
    a100 = catalog.lookup("a100-40gb")
    assert a100 is not None
    assert a100.total_memory == 40 * 2**30
    assert a100.peak_flops == pytest.approx(19.5e12)
    assert a100.extra["flops"]["bf16"] == pytest.approx(312e12)
    assert a100.extra["memory_bandwidth"] == pytest.approx(1555e9)
    assert a100.host_bandwidth == pytest.approx(32e9)  # PCIe Gen4 x16, one direction
    h100 = catalog.lookup("h100-80gb")
    assert h100 is not None and h100.host_bandwidth == pytest.approx(64e9)
    assert catalog.lookup("a100-80gb").extra["memory_bandwidth"] > a100.extra["memory_bandwidth"]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("token", "key"),
    [
        ("A100-40GB", "a100-40gb"),
        ("h100", "h100-80gb"),
        ("NVIDIA L4", "l4"),
        ("rtx4090", "rtx-4090"),
        ("RTX_4090", "rtx-4090"),
        ("tesla-t4", "t4"),
    ],
)
def test_aliases_and_case(token: str, key: str) -> None:
    dev = catalog.lookup(token)
    assert dev is not None and dev.extra["catalog"] == key


def test_unknown_and_ambiguous_names() -> None:
    assert catalog.lookup("b200") is None
    assert catalog.lookup("") is None
    with pytest.raises(ValueError, match="a100-40gb.*a100-80gb"):
        catalog.lookup("a100")


def test_flops_for_picks_the_precision() -> None:
    dev = catalog.lookup("a100-40gb")
    assert dev is not None
    assert catalog.flops_for(dev, torch.bfloat16) == (pytest.approx(312e12), "BF16 dense (tensor cores)")
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert catalog.flops_for(dev, torch.float32)[0] == pytest.approx(19.5e12)
        torch.set_float32_matmul_precision("high")
        flops, label = catalog.flops_for(dev, torch.float32)
        assert flops == pytest.approx(156e12) and label.startswith("TF32")
    finally:
        torch.set_float32_matmul_precision(previous)


def test_flops_for_without_figures_says_how_to_fix() -> None:
    plain = torchspan.devices("cpu")[0]
    with pytest.raises(ValueError, match="no FLOP/s figure"):
        catalog.flops_for(plain)


def test_devices_spec_numbers_described_accelerators() -> None:
    devs = torchspan.devices("a100-40gb*2,cpu", memory={"cuda:1": "20GiB"})
    assert [str(d) for d in devs] == ["cuda:0", "cuda:1", "cpu"]
    assert [d.present for d in devs] == [False, False, True]
    assert devs[1].budget == 20 * 2**30 and devs[0].budget is None
    assert devs[0].capacity == 40 * 2**30
    mixed = torchspan.devices("t4,l4,generic-cpu")
    assert [str(d) for d in mixed] == ["cuda:0", "cuda:1", "cpu"]
    assert mixed[2].kind == "cpu" and not mixed[2].present


def test_described_devices_cannot_be_run_on() -> None:
    dev = torchspan.devices("l4")[0]
    with pytest.raises(ValueError, match="described, not present"):
        torchspan.to_device(torch.zeros(1), dev)


def test_unknown_device_error_lists_catalog_names() -> None:
    with pytest.raises(ValueError, match="a100-40gb.*h100-80gb"):
        torchspan.devices("b200,cpu")


def test_host_speed_is_measured_once() -> None:
    first = catalog.measure_host()
    again = catalog.measure_host()
    assert first is again
    assert first.flops > 1e8 and first.memory_bandwidth > 1e8 and 0 < first.op_overhead < 1e-3
    assert first.method.startswith("measured")


def test_measuring_the_host_leaves_the_global_random_state_alone() -> None:
    # profile() measures the host on first use; a caller's seeded run must not shift because of it
    catalog._measure_host.cache_clear()
    before = torch.get_rng_state()
    catalog.measure_host()
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize(
    ("cuda_name", "key"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-80gb"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100 80GB PCIe", "a100-80gb"),
        ("Tesla V100-SXM2-32GB", "v100-32gb"),
        ("Tesla T4", "t4"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("NVIDIA L40S", None),
        ("NVIDIA GeForce RTX 3090", None),
    ],
)
def test_present_gpu_names_match_catalog_entries(cuda_name: str, key: str | None) -> None:
    found = catalog.match_name(cuda_name)
    assert (found.key if found else None) == key


def test_with_figures_fills_a_present_gpu_without_touching_others() -> None:
    gpu = torchspan.Device(torch.device("cuda", 0), "NVIDIA A100-SXM4-40GB", total_memory=40 * 2**30)
    filled = catalog.with_figures(gpu)
    assert filled.present and filled.peak_flops == pytest.approx(19.5e12)
    assert filled.extra["memory_bandwidth"] == pytest.approx(1555e9)
    assert gpu.peak_flops is None  # a copy
    cpu = torchspan.devices("cpu")[0]
    assert catalog.with_figures(cpu) is cpu
