"""The job's one ``DeviceMesh``: every parallel dimension of a launched span, by name, built once.

Dimensions in torchtitan's order, ``pp`` outermost, ``tp`` innermost (a node's neighbouring ranks share a
``tp`` group): ``ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")``. A mesh holds the dimensions of
degree > 1 and those its strategy asks for by name even at degree 1 (``keep``: a sharded replica of one rank
still shards over ``dp_shard``), so ``mesh["tp"]`` exists exactly where something splits over it. The degrees
are checked as one equation, ``pp(2) * dp_replicate(1) * dp_shard(3) != WORLD_SIZE(4)``.

Who asks for which sub-mesh: a data-parallel replica (DDP) ``mesh["dp_replicate"]``; a sharded replica (FSDP2)
``mesh["dp_shard"]``; tensor parallelism ``mesh["tp"]`` (and FSDP2 over ``dp_shard`` beside it); a pipeline
(``ranks.stage``) its stage's replicas ``mesh["dp_replicate"]`` (or ``"dp_shard"``, sharded), which also sum
the loss, and its pipeline ``mesh["pp"]``. A parameter tied across stages (first and last stage, every
replica) is not a sub-mesh: ``derived_group`` makes one process group over the ranks the mesh's rank tensor
gives those stages (Megatron's embedding group; one flat all-reduce, where a two-hop reduction over sub-meshes
would take two).

A pipeline's default numbering is torchspan's, ``rank = replica * stages + stage`` (neighbouring ranks hold a
pipeline's stages); a cluster plan's ``stage_ranks[stage][replica]`` may place them elsewhere: either is the
mesh's rank tensor (``DeviceMesh`` over ``table``, shape ``(pp, dp)``), so ``mesh["pp"]`` is always a
pipeline.

Usage::

    mesh = job_mesh("cpu", {"pp": 2, "dp_replicate": 2})           # ("pp", "dp_replicate"), rank = r * 2 + s
    mesh = job_mesh("cpu", {"dp_shard": 1}, keep=("dp_shard",))    # one rank, still named
    mesh = job_mesh("cpu", {"dp_replicate": 4}, given=user_mesh)   # the user's, checked
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ORDER", "equation", "check_degrees", "job_mesh", "sub_mesh", "derived_group", "dim_size"]

ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
_ALWAYS = ("pp", "dp_replicate", "dp_shard")  # printed in every equation


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def equation(degrees: Mapping[str, int], world: int) -> str:
    """``pp(2) * dp_replicate(1) * dp_shard(3) != WORLD_SIZE(4)`` for ``degrees`` (``cp``/``tp`` when > 1)."""
    names = [n for n in ORDER if n in _ALWAYS or degrees.get(n, 1) > 1 or n in degrees]
    return " * ".join(f"{n}({degrees.get(n, 1)})" for n in names) + f" != WORLD_SIZE({world})"


def check_degrees(degrees: Mapping[str, int], world: int | None = None, advice: str = "") -> None:
    """``ValueError`` printing the equation (and ``advice``: what to launch) when the degrees do not fill the
    world."""
    world = _world() if world is None else world
    unknown = [n for n in degrees if n not in ORDER]
    if unknown:
        raise ValueError(f"mesh dimension(s) {unknown} are not among {ORDER}")
    for n, d in degrees.items():
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(f"{n}={d!r} must be an int >= 1")
    product = 1
    for d in degrees.values():
        product *= d
    if product != world:
        raise ValueError(equation(degrees, world) + (f": {advice}" if advice else ""))


def _names(degrees: Mapping[str, int], keep: Sequence[str]) -> list[str]:
    names = [n for n in ORDER if degrees.get(n, 1) > 1 or n in keep]
    return names or [next((n for n in ORDER if n in degrees), "dp_replicate")]


def job_mesh(
    device_type: str,
    degrees: Mapping[str, int],
    *,
    keep: Sequence[str] = (),
    table: Any = None,
    given: Any = None,
    advice: str = "",
) -> Any:
    """The job's ``DeviceMesh`` for ``degrees`` (``{name: degree}``, names from ``ORDER``), checked as one
    equation.

    ``table``: the rank tensor (any shape holding the kept dimensions' sizes in ``ORDER``; default: ranks in
    order, ``init_device_mesh``). ``given``: a user's mesh (``span(mesh=)``), returned once its names and
    sizes are the degrees' (else ``ValueError`` naming ``mesh=``)."""
    check_degrees(degrees, advice=advice)
    names = _names(degrees, keep)
    shape = tuple(degrees.get(n, 1) for n in names)
    if given is not None:
        return check_given(given, degrees, names)
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    ranks = torch.arange(_world()).reshape(shape) if table is None else torch.as_tensor(table).reshape(shape)
    if "dp_shard" in names and (ranks.movedim(names.index("dp_shard"), -1).diff(dim=-1) <= 0).any():
        raise ValueError(
            f"the rank table {ranks.tolist()} lists a stage's sharded replicas out of rank order: FSDP2 "
            "places each shard by its rank's position in the mesh and all-gathers in rank order; list each "
            "stage's ranks in increasing order (plan.stage_ranks[stage]) or do not shard"
        )
    if torch.equal(ranks.flatten(), torch.arange(ranks.numel())):
        return init_device_mesh(device_type, shape, mesh_dim_names=tuple(names))
    return DeviceMesh(device_type, ranks, mesh_dim_names=tuple(names))


def check_given(mesh: Any, degrees: Mapping[str, int], names: Sequence[str]) -> Any:
    """A user's ``mesh=``: a ``DeviceMesh`` whose named dimensions are ``names`` (size-1 dimensions of
    ``ORDER`` may be added or left out) with the degrees' sizes, over the whole job."""
    from torch.distributed.device_mesh import DeviceMesh

    want = ", ".join(f"{n}={degrees.get(n, 1)}" for n in names)
    fix = (
        f"call span(model, mesh=init_device_mesh(device, {tuple(degrees.get(n, 1) for n in names)}, "
        f"mesh_dim_names={tuple(names)})), or leave mesh= out and torchspan builds it"
    )
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh={mesh!r} is not a torch DeviceMesh; this span needs dimensions {want}: {fix}")
    got = tuple(mesh.mesh_dim_names or ())
    sizes = dict(zip(got, mesh.shape)) if got else {}
    bad = (
        len(got) != mesh.ndim
        or any(n not in ORDER for n in got)
        or [n for n in ORDER if n in got] != list(got)
        or any(sizes.get(n, 1) != degrees.get(n, 1) for n in set(got) | set(names))
        or any(n not in got for n in names)
        or mesh.size() != _world()
    )
    if bad:
        have = ", ".join(f"{n}={s}" for n, s in sizes.items()) or f"unnamed {tuple(mesh.shape)}"
        raise ValueError(
            f"mesh= has dimensions ({have}) over {mesh.size()} of {_world()} ranks, but this span needs "
            f"({want}) in the order {ORDER}: {fix}"
        )
    return mesh


def sub_mesh(mesh: Any, name: str) -> Any:
    """``mesh[name]``, or ``None`` when ``mesh`` has no dimension ``name`` (its degree is 1)."""
    if mesh is None or name not in (mesh.mesh_dim_names or ()):
        return None
    return mesh[name] if mesh.ndim > 1 else mesh


def dim_size(mesh: Any, name: str) -> int:
    """The degree of dimension ``name`` in ``mesh`` (1 when absent)."""
    names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()
    return mesh.shape[names.index(name)] if name in names else 1


def derived_group(
    mesh: Any, name: str, indices: Sequence[int], per: str | None = None
) -> tuple[Any, list[int]]:
    """One process group over the ranks at ``indices`` of dimension ``name`` (every other coordinate), read
    from ``mesh``'s rank tensor; ``(group, its ranks sorted)``. Collective: every rank calls it in the same
    order. ``per``: one such group per coordinate of that dimension (a tie group per ``tp`` rank); this rank's
    returned."""
    names = tuple(mesh.mesh_dim_names or ())
    ranks = (
        mesh.mesh
        if name not in names
        else mesh.mesh.index_select(names.index(name), torch.tensor(sorted(set(indices))))
    )
    if per is None or per not in names:
        chosen = sorted(int(r) for r in ranks.flatten().tolist())
        return dist.new_group(chosen), chosen
    mine: tuple[Any, list[int]] | None = None
    for i in range(ranks.shape[names.index(per)]):
        chosen = sorted(int(r) for r in ranks.select(names.index(per), i).flatten().tolist())
        group = dist.new_group(chosen)
        mine = (group, chosen) if dist.get_rank() in chosen else mine
    assert mine is not None, f"rank {dist.get_rank()} is not in the mesh {mesh}"
    return mine
