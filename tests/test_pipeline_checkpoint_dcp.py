"""Sharded (DCP) checkpoints of a pipeline across ranks (issue 33 item 3): plain pp, pp x dp and 3-D pp x tp.

A tied decoder (embedding on the first stage tied to the head on the last, float64) trained one Adam step by
``span(model, balance=[2, 2])`` on 2 gloo ranks, by the same on 4 (two replicas of the pipeline) and by
``span(model, tp=2, balance=[2, 2])`` on 4 (each stage split over 2 tp ranks) and on 8 (3-D: pp 2 x dp 2 x
tp 2) is saved with
``save_checkpoint(folder, {"model": spanned, "optimizer": opt, "step": 1})``: each rank writes its stage's
entries (``ranks.dcpstages``). Its gathered full weights and Adam moments are one device's after one step,
and:

- (a) one plain process reads the folder as full tensors with the model's own keys in the model's order,
  equal to the gathered ones exactly, and loads it into a plain model + Adam whose next step is one
  device's;
- (b) the same layout loads it into a differently initialised span (its next step is the uninterrupted
  run's, bit for bit), and another layout does: a ``tp=2`` span and a data-parallel replica on 2 ranks, the
  2-stage pipeline and the pp x tp one, each exactly the gathered state, and their next step is one device's;
- a tp-split entry is stored as 2 chunks, a whole one (the tied weight, every replica's copy) as one;
- copies that drifted apart (a tied weight's two stages) are refused by name, nothing written.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks_spawn import join_job, spawn
from test_tensor_parallel_pipeline import PLAN, _decoder

import torchspan
from torchspan.runtime.ranks import free_port

EXACT = dict(rtol=0, atol=0)
NEAR = dict(rtol=1e-9, atol=1e-11)
LR = 0.05
LAYOUTS = {  # name -> (world size, span options)
    "pp": (2, dict(balance=[2, 2], microbatches=2)),
    "pp_dp": (4, dict(balance=[2, 2], microbatches=2)),
    "pp_tp": (4, dict(tp=2, balance=[2, 2], microbatches=2, tp_plan=PLAN)),
    "pp_dp_tp": (8, dict(tp=2, balance=[2, 2], microbatches=2, tp_plan=PLAN)),
}


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, 20, (6, 4), generator=torch.Generator().manual_seed(20 + step))


def _fresh(seed: int) -> torch.nn.Sequential:
    """A decoder of the same shapes, initialised otherwise: a load must bring every saved value."""
    model = _decoder()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def _reference(steps: int) -> dict[str, dict]:
    model = _decoder()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(steps):
        opt.zero_grad()
        _ce(model(_ids(step)), _ids(step)).backward()
        opt.step()
    return _full(model, opt)


def _full(module, opt) -> dict[str, dict]:
    """Every rank's held weights and Adam moments as full tensors, merged over ranks (a collective in a job),
    the weights in the model's own key order, the moments by parameter name."""
    module = getattr(module, "module", module)

    def whole(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    model = {k: whole(v) for k, v in module.state_dict().items() if not v.is_meta}
    moments = {
        n: {slot: whole(v) for slot, v in opt.state[p].items()}
        for n, p in module.named_parameters()
        if not p.is_meta and p in opt.state
    }
    if dist.is_initialized():
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, (model, moments))
        for held, state in every:
            model.update({k: v for k, v in held.items() if k not in model})
            moments.update({k: v for k, v in state.items() if k not in moments})
    order = list(module.state_dict())
    return {"model": {k: model[k] for k in order}, "moments": moments}


def _same(got: dict, want: dict, label: str, **tol: float) -> None:
    assert list(got["model"]) == list(want["model"]), f"{label}: keys {list(got['model'])}"
    for key, value in want["model"].items():
        torch.testing.assert_close(got["model"][key], value, **tol, msg=lambda m, k=key: f"{label}: {k}: {m}")
    assert set(got["moments"]) == set(want["moments"]), f"{label}: moments of {sorted(got['moments'])}"
    for name, slots in want["moments"].items():
        for slot, value in slots.items():
            torch.testing.assert_close(
                got["moments"][name][slot],
                value,
                **tol,
                msg=lambda m, n=name, s=slot: f"{label}: {n}.{s}: {m}",
            )


def _train(spanned, opt, step: int) -> None:
    opt.zero_grad()
    replica, replicas = spanned.data_parallel
    ids = torchspan.shard_batch(_ids(step), replica, replicas) if replicas > 1 else _ids(step)
    spanned.train_step(ids, ids, _ce)
    opt.step()


def _save_job(rank: int, world: int, port: int, folder: str, layout: str) -> None:
    join_job(rank, world, port)
    spanned = torchspan.span(_decoder(), **LAYOUTS[layout][1])
    module = spanned.module
    assert any(p.is_meta for p in module.parameters()), f"{layout}: not a pipeline across ranks"
    assert ("tp" in layout) == any(type(p).__name__ == "DTensor" for p in module.parameters())
    opt = torch.optim.Adam(spanned.parameters(), lr=LR)
    _train(spanned, opt, 0)
    saved = _full(spanned, opt)
    _same(saved, _reference(1), f"{layout}: one step against one device", **NEAR)
    ckpt = Path(folder, layout)
    assert torchspan.save_checkpoint(ckpt, {"model": spanned, "optimizer": opt, "step": 1}) is (rank == 0)
    if rank == 0:
        torch.save(saved, Path(folder, f"{layout}.saved.pt"))
    if layout == "pp":  # a tied copy that drifted apart: refused by name on every rank, nothing written
        kept = module[3].weight.detach().clone()
        if rank == 1:
            with torch.no_grad():
                module[3].weight.add_(1.0)
        with pytest.raises(ValueError, match=r"'model\.0\.weight' differs between rank 0 and rank 1"):
            torchspan.save_checkpoint(Path(folder, "drifted"), {"model": spanned, "optimizer": opt})
        dist.barrier()
        assert not Path(folder, "drifted").exists()
        with torch.no_grad():
            module[3].weight.copy_(kept)
        torchspan.save_checkpoint(Path(folder, "linear"), {"model": torch.nn.Linear(2, 2)})
        with torch.device("meta"):
            on_meta = torch.nn.Linear(2, 2)  # meta on every rank: no rank would load it
        with pytest.raises(ValueError, match=r"holds 'weight', 'bias' as meta on every rank"):
            torchspan.load_checkpoint(Path(folder, "linear"), {"model": on_meta})
    fresh = torchspan.span(_fresh(rank + 1), **LAYOUTS[layout][1])
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    state = torchspan.load_checkpoint(ckpt, {"model": fresh, "optimizer": fresh_opt})
    assert state is not None and state["step"] == 1 and fresh_opt.param_groups[0]["lr"] == LR
    _same(_full(fresh, fresh_opt), saved, f"{layout}: loaded in the same layout", **EXACT)
    _train(spanned, opt, 1)
    _train(fresh, fresh_opt, 1)
    _same(_full(fresh, fresh_opt), _full(spanned, opt), f"{layout}: resumed against uninterrupted", **EXACT)
    dist.barrier()
    dist.destroy_process_group()


def _load_job(rank: int, world: int, port: int, folder: str, into: str) -> None:
    """Each saved folder loaded into ``into``: the gathered state exactly, then one device's step."""
    join_job(rank, world, port)
    for layout in LAYOUTS:
        want = torch.load(Path(folder, f"{layout}.saved.pt"), weights_only=True)
        options = LAYOUTS[into][1] if into in LAYOUTS else dict(tp=2, tp_plan=PLAN) if into == "tp" else {}
        spanned = torchspan.span(_fresh(rank + 1), **options)
        opt = torch.optim.Adam(spanned.parameters(), lr=0.5)
        state = torchspan.load_checkpoint(Path(folder, layout), {"model": spanned, "optimizer": opt})
        label = f"saved by {layout}, loaded into {into} on {world} ranks"
        assert state is not None and state["step"] == 1 and opt.param_groups[0]["lr"] == LR, label
        _same(_full(spanned, opt), want, label, **EXACT)
        _train(spanned, opt, 1)
        _same(_full(spanned, opt), _reference(2), f"{label}, its next step", **NEAR)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("pp_dcp")
    for layout, (world, _) in LAYOUTS.items():
        spawn(_save_job, world, free_port(), str(folder), layout, deadline=300)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_pipeline_checkpoint_reads_in_one_plain_process(saved: Path, layout: str) -> None:
    want = torch.load(saved / f"{layout}.saved.pt", weights_only=True)
    assert not dist.is_initialized()
    full = torchspan.load_checkpoint(saved / layout)
    assert full is not None and list(full) == ["model", "optimizer", "step"] and full["step"] == 1
    assert all(type(v) is torch.Tensor for v in full["model"].values())
    _same({"model": full["model"], "moments": full["optimizer"]["state"]}, want, f"{layout}: read", **EXACT)
    model = _fresh(7)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    state = torchspan.load_checkpoint(saved / layout, {"model": model, "optimizer": opt})
    assert state is not None and state["step"] == 1 and model[3].weight is model[0].weight
    _same(_full(model, opt), want, f"{layout}: loaded into a plain model", **EXACT)
    opt.zero_grad()
    _ce(model(_ids(1)), _ids(1)).backward()
    opt.step()
    _same(_full(model, opt), _reference(2), f"{layout}: the plain model's next step", **NEAR)


@pytest.mark.slow
def test_a_pipeline_checkpoint_stores_tp_shards_split_and_copies_once(saved: Path) -> None:
    for layout in ("pp_tp", "pp_dp_tp"):
        with open(saved / layout / ".metadata", "rb") as fh:
            metadata = pickle.load(fh)
        chunks = {k: len(getattr(v, "chunks", [])) for k, v in metadata.state_dict_metadata.items()}
        assert chunks["model.1.up.weight"] == chunks["model.2.down.weight"] == 2, (layout, chunks)
        assert chunks["optimizer.state.1.up.weight.exp_avg"] == 2, (layout, chunks)
        assert chunks["model.0.weight"] == chunks["model.3.weight"] == 1, (layout, chunks)
    for layout in LAYOUTS:
        with open(saved / layout / ".metadata", "rb") as fh:
            items = pickle.load(fh).storage_data
        names = [index.fqn for index in items]
        assert len(names) == len(set((i.fqn, tuple(i.offset or ())) for i in items)), layout
        assert names.count("model.0.weight") == 1, (
            f"{layout}: the tied weight written {names.count('model.0.weight')}x"
        )


@pytest.mark.slow
@pytest.mark.parametrize("into", ["tp", "replica", "pp", "pp_tp"])
def test_a_pipeline_checkpoint_loads_in_another_layout(saved: Path, into: str) -> None:
    world = LAYOUTS[into][0] if into in LAYOUTS else 2
    spawn(_load_job, world, free_port(), str(saved), into, deadline=300)


@pytest.mark.slow
def test_a_3d_pipeline_checkpoint_exports_full_weights(saved: Path, tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch", reason="export_safetensors needs safetensors")
    want = torch.load(saved / "pp_tp.saved.pt", weights_only=True)["model"]
    out = torchspan.export_safetensors(saved / "pp_tp", tmp_path / "export")
    tensors = safetensors.load_file(out)
    assert set(tensors) == set(want) - {"3.weight"}, sorted(tensors)  # the tie across stages written once
    for key, value in tensors.items():
        torch.testing.assert_close(value, want[key], **EXACT, msg=lambda m, k=key: f"export: {k}: {m}")
