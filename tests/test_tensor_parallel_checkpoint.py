"""Checkpoints of a tensor-parallel span (issue 33 item 3): DCP folders of ``DTensor`` shards over a 1-D or
2-D mesh.

A tied GQA Llama (float64) trained one Adam step by ``span(model, tp=2)`` on 2 gloo ranks, and by
``span(model, tp=2, shard=True)`` on 4 (mesh ``("dp_shard", "tp")``), is saved with ``save_checkpoint(folder,
{"model": spanned, "optimizer": opt, "step": 3})``, each rank writing its shards. Its full weights and Adam
moments (gathered before the save) are the one-device reference's after one Adam step (to float32 loss
rounding), and every load finds them exactly:

- (a) the same layout, loaded into a differently initialised span and optimizer; its next step is the
  uninterrupted run's (bit for bit) and the one-device reference's second step;
- (b) another layout: the tp=2 folder on tp=2 x dp_shard=2 (4 ranks) and into a plain data-parallel replica,
the
  tp=2 x dp_shard=2 folder on tp=2 (2 ranks);
- (c) one plain process without a process group: full tensors with the model's own keys, loaded into a plain
  ``LlamaForCausalLM`` + Adam; ``export_safetensors`` writes one file of the full weights (the tie once) that
  ``from_pretrained`` reads to the same weights.

Beside them (found timing ``benchmarks/distributed_tp.py``): a tensor-parallel span's activation meter leaves
its ``DTensor`` weight shards out, as it leaves out every parameter (they were counted as saved activations).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks_spawn import join_job, spawn
from test_ranks_checkpoint_dcp import _same  # model keys in order, then every optimizer moment
from torch.utils._pytree import tree_map

import torchspan
from torchspan.runtime.ranks import free_port

transformers = pytest.importorskip("transformers", reason="the Llama case needs the hf extra")

EXACT = dict(rtol=0, atol=0)
NEAR = dict(rtol=1e-6, atol=1e-9)  # the model's own loss is float32: split sums round differently
LR = 0.01


def _llama(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).double()


def _batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    ids = torch.randint(1, 40, (4, 7), generator=g)
    mask = torch.ones(4, 7, dtype=torch.long)
    mask[0, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _reference(steps: int) -> dict[str, dict]:
    """One device's model and Adam state after ``steps`` Adam steps on the whole batches."""
    model = _llama()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(steps):
        opt.zero_grad()
        model(**_batch(step)).loss.backward()
        opt.step()
    return _full_state(model, opt)


def _full_state(module, opt) -> dict[str, dict]:
    """Full weights and optimizer state (a collective where they are split); the optimizer's keyed by name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    module = getattr(module, "module", module)
    full = StateDictOptions(full_state_dict=True)
    model = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in module.state_dict().items()}
    state = {"model": model, "optimizer": get_optimizer_state_dict(module, opt, options=full)}
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, state)


def _span(seed: int, layout: str):
    """A span in ``layout`` ("tp": 2 ranks; "tp_shard": tp=2 x dp_shard=2; "replica": data parallel) +
    Adam."""
    options = {"tp": dict(tp=2), "tp_shard": dict(tp=2, shard=True), "replica": {}}[layout]
    spanned = torchspan.span(_llama(seed), **options)
    return spanned, torch.optim.Adam(
        spanned.parameters(), lr=0.5 if seed else LR
    )  # another lr: the saved one comes back


def _step(spanned, opt, step: int) -> None:
    opt.zero_grad()
    replica, replicas = spanned.data_parallel
    spanned.train_step(
        torchspan.shard_batch(_batch(step), replica, replicas) if replicas > 1 else _batch(step)
    )
    opt.step()


def _save_job(rank: int, world: int, port: int, folder: str, layout: str) -> None:
    """Train one step in ``layout``, save, reload in the same layout (a), resume one step: the uninterrupted
    run."""
    join_job(rank, world, port)
    spanned, opt = _span(0, layout)
    assert (
        spanned.mesh is not None
        and type(spanned.module.model.layers[0].mlp.up_proj.weight).__name__ == "DTensor"
    )
    _step(spanned, opt, 0)
    saved = _full_state(spanned, opt)
    _same(saved, _reference(1), f"{layout}: one step against one device", **NEAR)
    ckpt = Path(folder, layout)
    assert torchspan.save_checkpoint(ckpt, {"model": spanned, "optimizer": opt, "step": 3}) is (rank == 0)
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(
        [".metadata", "torchspan.json", "values.pt", *(f"__{r}_0.distcp" for r in range(world))]
    )
    if rank == 0:
        torch.save(saved, Path(folder, f"{layout}.saved.pt"))
    fresh, fresh_opt = _span(1, layout)
    state = torchspan.load_checkpoint(ckpt, {"model": fresh, "optimizer": fresh_opt})
    assert (
        state is not None
        and state["step"] == 3
        and state["model"] is fresh
        and fresh_opt.param_groups[0]["lr"] == LR
    )
    _same(_full_state(fresh, fresh_opt), saved, f"{layout}: loaded in the same layout", **EXACT)
    _step(spanned, opt, 1)
    _step(fresh, fresh_opt, 1)
    after = _full_state(spanned, opt)
    _same(
        _full_state(fresh, fresh_opt), after, f"{layout}: resumed step against the uninterrupted run", **EXACT
    )
    _same(after, _reference(2), f"{layout}: two steps against one device", **NEAR)
    dist.barrier()
    dist.destroy_process_group()


def _other_layout_job(rank: int, world: int, port: int, folder: str, pairs: list[tuple[str, str]]) -> None:
    """Load each saved ``(folder layout, into layout)`` pair (b): the saved full state exactly, then a
    step."""
    join_job(rank, world, port)
    for saved_as, layout in pairs:
        saved = torch.load(Path(folder, f"{saved_as}.saved.pt"), weights_only=True)
        fresh, fresh_opt = _span(1, layout)
        state = torchspan.load_checkpoint(Path(folder, saved_as), {"model": fresh, "optimizer": fresh_opt})
        assert state is not None and state["step"] == 3
        label = f"saved by {saved_as}, loaded into {layout} on {world} ranks"
        _same(_full_state(fresh, fresh_opt), saved, label, **EXACT)
        _step(fresh, fresh_opt, 1)
        _same(_full_state(fresh, fresh_opt), _reference(2), f"{label}, its next step", **NEAR)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tp_dcp")
    spawn(_save_job, 2, free_port(), str(folder), "tp", deadline=300)
    spawn(_save_job, 4, free_port(), str(folder), "tp_shard", deadline=300)
    return folder


@pytest.mark.slow
def test_a_tensor_parallel_span_saves_and_loads_in_its_own_layout(saved: Path) -> None:
    for layout in ("tp", "tp_shard"):  # the fixture's jobs checked (a); their folders are whole
        assert (saved / layout / ".metadata").is_file() and (saved / f"{layout}.saved.pt").is_file()


@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_loads_in_another_layout(saved: Path) -> None:
    spawn(
        _other_layout_job, 4, free_port(), str(saved), [("tp", "tp_shard"), ("tp", "replica")], deadline=300
    )
    spawn(
        _other_layout_job,
        2,
        free_port(),
        str(saved),
        [("tp_shard", "tp"), ("tp_shard", "replica")],
        deadline=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp", "tp_shard"])
def test_one_plain_process_reads_a_tensor_parallel_checkpoint(saved: Path, layout: str) -> None:
    want = torch.load(saved / f"{layout}.saved.pt", weights_only=True)
    assert not dist.is_initialized()
    full = torchspan.load_checkpoint(saved / layout)
    assert full is not None and list(full) == ["model", "optimizer", "step"] and full["step"] == 3
    assert all(type(v) is torch.Tensor for v in full["model"].values())
    _same(full, want, f"{layout}: read in one process", **EXACT)
    model = _llama(1)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    assert torchspan.load_checkpoint(saved / layout, {"model": model, "optimizer": opt})["step"] == 3  # type: ignore[index]
    assert model.lm_head.weight is model.model.embed_tokens.weight and not dist.is_initialized()
    _same(_full_state(model, opt), want, f"{layout}: loaded into a plain model", **EXACT)
    opt.zero_grad()
    model(**_batch(1)).loss.backward()
    opt.step()
    _same(_full_state(model, opt), _reference(2), f"{layout}: the plain model's next step", **NEAR)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp", "tp_shard"])
def test_a_tensor_parallel_checkpoint_exports_full_weights(saved: Path, layout: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    want = torch.load(saved / f"{layout}.saved.pt", weights_only=True)["model"]
    out = torchspan.export_safetensors(saved / layout, tmp_path / "hf")
    assert sorted(p.name for p in out.parent.iterdir()) == ["config.json", "model.safetensors"]
    tensors = load_file(out)
    assert set(tensors) == set(want) - {"lm_head.weight"}  # the tie written once
    for key, value in tensors.items():
        torch.testing.assert_close(value, want[key], **EXACT, msg=lambda m: f"{layout}: {key}: {m}")
    model = transformers.LlamaForCausalLM.from_pretrained(out.parent, dtype=torch.float64)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for key, value in want.items():
        torch.testing.assert_close(
            model.state_dict()[key], value, **EXACT, msg=lambda m: f"{layout}: from_pretrained: {key}: {m}"
        )


def _meter_job(rank: int, world: int, port: int) -> None:
    from torchspan.runtime.memory import ActivationMeter

    join_job(rank, world, port)
    spanned = torchspan.span(_llama(), tp=2)
    meter = ActivationMeter(1)
    meter.reset(spanned.module.parameters())
    shards = [p for p in spanned.module.parameters() if type(p).__name__ == "DTensor"]
    assert shards and all(meter.hold(0, p) is p for p in shards) and meter.live == [0], (
        "a weight shard counted as an activation"
    )
    spanned.train_step(_batch(0))
    activations = spanned.memory()[0]["activations"]
    meter.reset(spanned.module.parameters())  # the same step by hand, parameters left out: the same bytes
    with meter.saving(0):
        loss = spanned.module(**_batch(0)).loss
    loss.backward()
    assert activations == meter.peak[0] > 0
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_activation_meter_leaves_out_weight_shards() -> None:
    spawn(_meter_job, 2, free_port())
