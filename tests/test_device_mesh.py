"""The job's one DeviceMesh (runtime.ranks.devicemesh): the degree equation, span(mesh=), spanned.mesh per
strategy.

4 gloo ranks run, each on one mesh: replicas (dp_replicate), sharded replicas (dp_shard), a 2 x 2 pipeline
(pp, dp_replicate: rank = replica * 2 + stage), the same pipeline sharded (pp, dp_shard), tensor parallel
(tp), a user's mesh in torchtitan's numbering (rank = stage * 2 + replica: the stages follow it, gradients one
device's), and user meshes that do not fit (refused naming mesh=).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from ranks_spawn import join_job, spawn
from torch import nn

import torchspan
from torchspan.runtime.ranks import free_port, shard_batch
from torchspan.runtime.ranks.devicemesh import check_degrees, equation

SRC = Path(__file__).resolve().parents[1] / "src" / "torchspan"


def test_degrees_are_one_equation_printed_when_they_do_not_fill_the_world() -> None:
    check_degrees({"pp": 2, "dp_replicate": 2}, 4)
    with pytest.raises(
        ValueError, match=re.escape("pp(2) * dp_replicate(1) * dp_shard(3) != WORLD_SIZE(4): launch 6")
    ):
        check_degrees({"pp": 2, "dp_replicate": 1, "dp_shard": 3}, 4, "launch 6 processes")
    assert (
        equation({"dp_shard": 2, "tp": 4}, 4)
        == "pp(1) * dp_replicate(1) * dp_shard(2) * tp(4) != WORLD_SIZE(4)"
    )
    with pytest.raises(ValueError, match="not among"):
        check_degrees({"dp": 4}, 4)


def test_no_process_group_is_made_outside_the_mesh_module() -> None:
    makers = [p for p in SRC.rglob("*.py") if "new_group(" in p.read_text() and p.name != "devicemesh.py"]
    assert makers == [], f"process groups made outside runtime/ranks/devicemesh.py: {makers}"


def _seq() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 6), nn.Linear(6, 4)).double()


def _exact(spanned: object, model: nn.Module, replica: int, replicas: int) -> None:
    """One train step on this replica's shard leaves one device's gradients in every real parameter."""
    g = torch.Generator().manual_seed(3)
    x, y = (
        torch.randn(6, 5, generator=g, dtype=torch.float64),
        torch.randn(6, 4, generator=g, dtype=torch.float64),
    )
    reference = _seq()
    spanned.train_step(*shard_batch((x, y), replica, replicas), nn.MSELoss())  # type: ignore[attr-defined]
    nn.MSELoss()(reference(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if p.device.type != "meta" and p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{name}: {m}")


def _worker(rank: int, world: int, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    join_job(rank, world, port)
    spanned = torchspan.span(_seq())
    assert spanned.mesh.mesh_dim_names == ("dp_replicate",) and spanned.mesh.size() == 4
    spanned = torchspan.span(_seq(), shard=True)
    assert spanned.mesh.mesh_dim_names == ("dp_shard",) and spanned.mesh.size() == 4
    model = _seq()
    spanned = torchspan.span(model, balance=[2, 2], microbatches=2)
    mesh = spanned.mesh
    assert mesh.mesh_dim_names == ("pp", "dp_replicate") and mesh.mesh.tolist() == [[0, 2], [1, 3]]
    assert mesh["pp"].mesh.tolist() == [rank // 2 * 2, rank // 2 * 2 + 1] and spanned.data_parallel == (
        rank // 2,
        2,
    )
    _exact(spanned, model, rank // 2, 2)
    spanned = torchspan.span(_seq(), balance=[2, 2], shard=True)
    assert spanned.mesh.mesh_dim_names == ("pp", "dp_shard") and spanned.mesh["dp_shard"].mesh.tolist() == [
        rank % 2,
        rank % 2 + 2,
    ]
    spanned = torchspan.span(_seq().float(), tp=4, tp_plan={"0": "colwise", "2": "rowwise"})
    assert spanned.mesh.mesh_dim_names == ("tp",)

    titan = init_device_mesh(
        "cpu", (2, 2), mesh_dim_names=("pp", "dp_replicate")
    )  # rank = stage * 2 + replica
    model = _seq()
    spanned = torchspan.span(model, balance=[2, 2], microbatches=2, mesh=titan)
    assert spanned.mesh is titan and spanned.data_parallel == (rank % 2, 2)
    assert [p.device.type != "meta" for p in model[0].parameters()] == [
        rank < 2
    ] * 2  # ranks 0, 1 hold stage 0
    _exact(spanned, model, rank % 2, 2)
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    assert torchspan.span(_seq(), shard=True, mesh=flat).mesh is flat
    for options, mesh in [
        (dict(balance=[2, 2]), flat),  # a pipeline needs pp
        (dict(), flat),  # DDP replicas need dp_replicate
        (dict(balance=[2, 2], shard=True), titan),  # sharded stages need dp_shard
        (dict(), "not a mesh"),
    ]:
        with pytest.raises(ValueError, match=r"mesh="):
            torchspan.span(_seq(), mesh=mesh, **options)


@pytest.mark.slow
def test_every_launched_strategy_runs_on_one_named_mesh() -> None:
    spawn(_worker, 4, free_port(), deadline=240)


def test_a_mesh_for_one_process_is_refused() -> None:
    with pytest.raises(ValueError, match="mesh= was given, but this span runs in one process"):
        torchspan.span(_seq(), devices=["cpu", "cpu"], mesh=object())
