"""A model built on ``meta``, spanned with ``weights=``: each rank materializes and fills only what it holds
(issue 20 item 6).

Two gloo ranks of a normal run save a sharded, tied Llama (float64) with ``save_checkpoint``; the parent
exports it to one safetensors file and takes one device's gradients on the whole batch. Then a fresh 2-rank
job builds the same Llama under ``torch.device("meta")`` and spans it ``shard=True`` three ways:

- ``weights=<the DCP folder>`` and ``weights=<the safetensors folder>``: every parameter a ``DTensor`` whose
local
  shard is this rank's rows, the rank's parameter bytes exactly half the model's, and no op on the rank ever
  saw a tensor of a parameter's full shape (the shard shapes differ from every full shape in this config):
  nothing was materialized whole, only the rank's chunks read;
- ``weights="init"``: the model's own initialisation replayed, bit-equal to the normal build after the same
seed
  (the generator ends where that build leaves it), one parameter's temporary at a time (the largest one's
  bytes);

and in each case the weights are the reference's bit for bit and the first ``train_step``'s gradients (uneven
shards) are one device's. A meta model without weights is refused on every rank before any work. A pipeline
job (2 stages of an ``nn.Sequential``; and a transformers Llama through its own forward) materializes only its
stage: the other stage's parameters stay ``meta`` and, from a checkpoint, no tensor of their shapes is ever
seen on the rank.
One process: the initialisation is bit-equal for transformers and ``torch.nn`` layers, stages on their
devices, transformers' sharded safetensors layout, a tensor no initialisation writes refused by name, the
refusals.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_ranks_pipeline import _leave, _spawn
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import torchspan
from torchspan.runtime.ranks import export_safetensors, free_port, save_checkpoint, shard_batch
from torchspan.runtime.ranks.sharded import local_bytes

transformers = pytest.importorskip("transformers")

EXACT = dict(rtol=0, atol=0)
GRAD = dict(rtol=1e-10, atol=1e-12)  # float64: ranks sum their shards' gradients in another order


def _config(tie: bool = True) -> Any:
    # shapes chosen so that no shard shape (2 ranks) equals any parameter's full shape
    return transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=tie,
        max_position_embeddings=32,
    )


@contextlib.contextmanager
def _float64() -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _llama(meta: bool = False, seed: int = 0, tie: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    with torch.device("meta") if meta else contextlib.nullcontext():
        return transformers.LlamaForCausalLM(_config(tie))


def _seq(meta: bool = False) -> nn.Module:
    torch.manual_seed(2)
    with torch.device("meta") if meta else contextlib.nullcontext():
        return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 12), nn.Linear(12, 4))


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 50, (5, 9), generator=g)
    labels = ids.clone()
    labels[1, :4] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _xy() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(6)
    return torch.randn(7, 6, generator=g, dtype=torch.float64), torch.randn(
        7, 4, generator=g, dtype=torch.float64
    )


class _Shapes(TorchDispatchMode):
    """Every shape of a float64 CPU tensor an op takes or gives (a ``DTensor``'s local shard included)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((args, kwargs, out)):
            t = getattr(t, "_local_tensor", t)
            if type(t) is torch.Tensor and t.device.type == "cpu" and t.dtype == torch.float64:
                self.shapes.add(tuple(t.shape))
        return out


@contextlib.contextmanager
def _temporaries() -> Iterator[SimpleNamespace]:
    """The most bytes the initialisation's replay held in temporaries at once (``metainit.Replay``)."""
    from torchspan.runtime import metainit

    real, box = metainit.Replay._start, SimpleNamespace(peak=0)

    def start(self: Any, key: int, fresh: bool) -> torch.Tensor:
        temp = real(self, key, fresh)
        box.peak = max(box.peak, sum(v.nbytes for v in self.temps.values()))
        return temp

    metainit.Replay._start = start  # type: ignore[method-assign]
    try:
        yield box
    finally:
        metainit.Replay._start = real  # type: ignore[method-assign]


def _verdict(folder: str, name: str, rank: int, case: Any) -> None:
    try:
        case()
        text = "ok"
    except BaseException:
        text = "FAILED " + traceback.format_exc()
    Path(folder, f"{name}.rank{rank}.txt").write_text(text)


def _verdicts(folder: Path, name: str, world: int = 2) -> None:
    for rank in range(world):
        path = folder / f"{name}.rank{rank}.txt"
        assert path.exists(), f"rank {rank} wrote no verdict for {name}"
        assert path.read_text() == "ok", f"rank {rank}:\n{path.read_text()}"


def _join(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    torchspan.init_distributed(timeout=60)


# ------------------------------------------------------------------------------------------------ the jobs


def _save_job(rank: int, world: int, port: int, folder: str) -> None:
    """A normal run: the model built whole on every rank, sharded, saved (each rank writes its shards)."""
    _join(rank, world, port)
    spanned = torchspan.span(_llama(), shard=True)
    save_checkpoint(Path(folder, "ckpt"), {"model": spanned, "step": 0})
    _leave()


def _sharded_case(folder: str, rank: int, world: int, weights: str, reference: dict[str, Any]) -> None:
    state, grads = reference["state"], reference["grads"]
    full_shapes = {tuple(t.shape) for t in state.values()}
    with _Shapes() as seen, _temporaries() as temps:
        spanned = torchspan.span(_llama(meta=True), shard=True, weights=weights)
    assert spanned.mode == "sharded"
    if weights == "init":
        assert torch.equal(torch.get_rng_state(), reference["rng_after"]), (
            "the generator is not where a normal build leaves it"
        )
        largest = max(t.numel() * t.element_size() for t in state.values())
        assert 0 < temps.peak <= largest, (
            f"init held {temps.peak} bytes of temporaries at once (largest parameter: {largest})"
        )
    else:
        assert temps.peak <= 24 * 8, (
            temps.peak
        )  # only the rotary buffers, which no checkpoint holds, are initialised
        assert not seen.shapes & full_shapes, f"rank {rank} saw full-size tensors {seen.shapes & full_shapes}"
    whole = sum(t.numel() * t.element_size() for n, t in state.items() if n != "lm_head.weight")
    for name, p in spanned.module.named_parameters():
        rows = state[name].shape[0] // world
        assert type(p).__name__ == "DTensor" and tuple(p.to_local().shape) == (
            rows,
            *state[name].shape[1:],
        ), name
    held = local_bytes(spanned.module)["params"]
    assert held * world == whole, f"rank {rank} holds {held} bytes of a {whole}-byte model"
    for key, value in spanned.state_dict().items():  # gathered, only to compare
        torch.testing.assert_close(value, state[key], **EXACT, msg=lambda m: f"{weights}: {key}: {m}")
    torch.testing.assert_close(spanned.module.model.rotary_emb.inv_freq, reference["inv_freq"], **EXACT)
    loss = spanned.train_step(shard_batch(_batch(), rank, world))
    assert float(loss) == pytest.approx(float(reference["loss"]), rel=1e-6)
    for name, p in spanned.module.named_parameters():
        torch.testing.assert_close(
            p.grad.full_tensor(), grads[name], **GRAD, msg=lambda m: f"{weights}: grad {name}: {m}"
        )


def _sharded_job(rank: int, world: int, port: int, folder: str) -> None:
    _join(rank, world, port)
    reference = torch.load(Path(folder, "reference.pt"), weights_only=True)
    for name, weights in (
        ("dcp", str(Path(folder, "ckpt"))),
        ("safetensors", str(Path(folder, "hf"))),
        ("init", "init"),
    ):
        _verdict(
            folder, f"sharded_{name}", rank, lambda: _sharded_case(folder, rank, world, weights, reference)
        )

    def refused() -> None:
        with pytest.raises(
            ValueError,
            match=r"the model is on the meta device .*weights='init'.*weights='path/to/checkpoint'",
        ):
            torchspan.span(_llama(meta=True), shard=True)

    _verdict(folder, "sharded_refused", rank, refused)

    def replica() -> None:  # not sharded: a data-parallel replica holds the whole model, initialised alike
        spanned = torchspan.span(_seq(meta=True), weights="init")
        assert spanned.mode == "data-parallel"
        for (name, p), q in zip(spanned.module.named_parameters(), reference["seq"].values()):
            torch.testing.assert_close(p, q, **EXACT, msg=lambda m: f"{name}: {m}")

    _verdict(folder, "replica", rank, replica)
    _leave()


def _stage_case(folder: str, rank: int, world: int, weights: str, reference: dict[str, Any]) -> None:
    state, grads = reference["seq"], reference["seq_grads"]
    mine = ["0.weight", "0.bias"] if rank == 0 else ["2.weight", "2.bias", "3.weight", "3.bias"]
    others = {tuple(t.shape) for n, t in state.items() if n not in mine}
    with _Shapes() as seen:
        spanned = torchspan.span(_seq(meta=True), balance=[2, 2], microbatches=2, weights=weights)
    if weights != "init":
        assert not seen.shapes & others, f"rank {rank} saw another stage's tensors {seen.shapes & others}"
    params = dict(spanned.module.named_parameters())
    assert sorted(n for n, p in params.items() if not p.is_meta) == sorted(mine)
    for name in mine:
        torch.testing.assert_close(
            params[name], state[name], **EXACT, msg=lambda m: f"{weights}: {name}: {m}"
        )
    spanned.train_step(*_xy(), nn.MSELoss())
    for name in mine:
        torch.testing.assert_close(
            params[name].grad, grads[name], **GRAD, msg=lambda m: f"{weights}: grad {name}: {m}"
        )


def _pipeline_job(rank: int, world: int, port: int, folder: str) -> None:
    _join(rank, world, port)
    reference = torch.load(Path(folder, "reference.pt"), weights_only=True)
    for name, weights in (
        ("dcp", str(Path(folder, "seq"))),
        ("safetensors", str(Path(folder, "seq.safetensors"))),
        ("init", "init"),
    ):
        _verdict(folder, f"stage_{name}", rank, lambda: _stage_case(folder, rank, world, weights, reference))

    def own_forward() -> (
        None
    ):  # a transformers model across ranks: its own forward, this rank's blocks for real
        spanned = torchspan.span(_llama(meta=True), balance=[3, 3], weights="init")
        spanned.train_step(_batch())  # the first call records the order and places (and fills) this stage
        held = {n: p for n, p in spanned.module.named_parameters() if not p.is_meta}
        assert ("model.layers.0.mlp.up_proj.weight" in held) == (rank == 0) and (
            "model.norm.weight" in held
        ) == (rank == 1)
        for name, p in held.items():
            torch.testing.assert_close(
                p.detach(), reference["state"][name], **EXACT, msg=lambda m: f"{name}: {m}"
            )
            torch.testing.assert_close(
                p.grad, reference["grads"][name], **GRAD, msg=lambda m: f"grad {name}: {m}"
            )

    _verdict(folder, "own_forward", rank, own_forward)
    _leave()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The normal run's checkpoint (2 ranks), its safetensors export, and one device's reference."""
    folder = tmp_path_factory.mktemp("meta")
    _spawn(_save_job, 2, free_port(), str(folder), deadline=300.0)
    export_safetensors(folder / "ckpt", folder / "hf")
    with _float64():
        reference = _llama()
        rng_after = torch.get_rng_state()
        out = reference(**_batch())
        out.loss.backward()
        seq = _seq()
        save_checkpoint(folder / "seq", {"model": seq})
        from safetensors.torch import save_file

        save_file(seq.state_dict(), str(folder / "seq.safetensors"))
        nn.MSELoss()(seq(_xy()[0]), _xy()[1]).backward()
    torch.save(
        {
            "state": reference.state_dict(),
            "grads": {n: p.grad for n, p in reference.named_parameters()},
            "loss": out.loss.detach().float(),
            "inv_freq": reference.model.rotary_emb.inv_freq,
            "rng_after": rng_after,
            "seq": seq.state_dict(),
            "seq_grads": {n: p.grad for n, p in seq.named_parameters()},
        },
        folder / "reference.pt",
    )
    return folder


@pytest.fixture(scope="module")
def sharded(saved: Path) -> Path:
    _spawn(_sharded_job, 2, free_port(), str(saved), deadline=400.0)
    return saved


@pytest.fixture(scope="module")
def pipelined(saved: Path) -> Path:
    _spawn(_pipeline_job, 2, free_port(), str(saved), deadline=400.0)
    return saved


@pytest.mark.slow
@pytest.mark.parametrize("source", ["dcp", "safetensors"])
def test_sharded_ranks_read_only_their_shards_from_a_checkpoint(sharded: Path, source: str) -> None:
    _verdicts(sharded, f"sharded_{source}")


@pytest.mark.slow
def test_sharded_ranks_initialise_their_shards_as_a_normal_build(sharded: Path) -> None:
    _verdicts(sharded, "sharded_init")


@pytest.mark.slow
def test_a_meta_model_without_weights_is_refused_on_every_rank(sharded: Path) -> None:
    _verdicts(sharded, "sharded_refused")


@pytest.mark.slow
def test_a_data_parallel_replica_of_a_meta_model(sharded: Path) -> None:
    _verdicts(sharded, "replica")


@pytest.mark.slow
@pytest.mark.parametrize("source", ["dcp", "safetensors", "init"])
def test_a_pipeline_rank_materializes_only_its_stage(pipelined: Path, source: str) -> None:
    _verdicts(pipelined, f"stage_{source}")


@pytest.mark.slow
def test_a_transformers_pipeline_rank_materializes_only_its_blocks(pipelined: Path) -> None:
    _verdicts(pipelined, "own_forward")


# ------------------------------------------------------------------------------------------- one process


class _Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(5, 7),
            nn.LayerNorm(7),
            nn.Conv1d(2, 3, 3),
            nn.BatchNorm1d(3),
            nn.MultiheadAttention(8, 2),
            nn.LSTM(3, 4),
        )
        self.embed = nn.Embedding(6, 3, padding_idx=1)
        self.head = nn.Linear(3, 6, bias=False)
        self.head.weight = self.embed.weight  # tied after both were initialised: the embedding's values


_BUILDS = {
    "llama tied": lambda: transformers.LlamaForCausalLM(_config()),
    "llama untied": lambda: transformers.LlamaForCausalLM(_config(tie=False)),
    "from_config": lambda: transformers.AutoModelForCausalLM.from_config(_config()),
    "torch layers": _Layers,
    "nn.Transformer": lambda: nn.Transformer(16, 2, 1, 1, 32, batch_first=True),
}


@pytest.mark.parametrize("build", list(_BUILDS))
def test_init_is_bit_equal_to_a_normal_build(build: str) -> None:
    with _float64():
        torch.manual_seed(3)
        reference = _BUILDS[build]()
        after = torch.get_rng_state()
        torch.manual_seed(3)
        with torch.device("meta"):
            model = _BUILDS[build]()
        spanned = torchspan.span(model, weights="init")
    assert torch.equal(torch.get_rng_state(), after)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    want = dict(reference.named_buffers()) | dict(reference.named_parameters())
    got = dict(spanned.module.named_buffers()) | dict(spanned.module.named_parameters())
    assert list(got) == list(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, **EXACT, msg=lambda m: f"{build}: {name}: {m}")


def test_one_process_stages_on_their_devices_train_as_one_device() -> None:
    with _float64():
        reference = _llama(seed=4)
        spanned = torchspan.span(
            _llama(meta=True, seed=4), devices=["cpu", "cpu"], balance=[3, 3], weights="init"
        )
        reference(**_batch()).loss.backward()
        spanned.train_step(_batch())
    for (name, p), q in zip(spanned.module.named_parameters(), reference.parameters()):
        assert p.device.type == "cpu"
        torch.testing.assert_close(p.grad, q.grad, **GRAD, msg=lambda m: f"{name}: {m}")


def test_transformers_sharded_safetensors_folder(tmp_path: Path) -> None:
    with _float64():
        reference = _llama(seed=5)
        reference.save_pretrained(tmp_path, max_shard_size="20KB")
        assert (tmp_path / "model.safetensors.index.json").is_file()
        spanned = torchspan.span(_llama(meta=True), weights=tmp_path)
    for (name, p), q in zip(spanned.module.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(p, q, **EXACT, msg=lambda m: f"{name}: {m}")


def test_one_module_at_a_time() -> None:
    with _float64(), _temporaries() as temps:
        model = _llama(meta=True)
        torchspan.span(model, weights="init")
    largest = max(p.numel() * 8 for p in model.parameters())
    whole = sum(p.numel() * 8 for p in model.parameters())
    assert 0 < temps.peak <= largest < whole / 8


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scale = nn.Parameter(
            torch.ones(3)
        )  # made in __init__: no reset_parameters gives it a value on meta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_a_tensor_no_initialisation_writes_is_refused_by_name() -> None:
    with torch.device("meta"):
        model = _Scaled()
    with pytest.raises(
        ValueError, match=r"no initialisation writes 'scale' whole .*reset_parameters\(\).*weights=callable"
    ):
        torchspan.span(model, weights="init")
    with torch.device("meta"):
        model = _Scaled()
    torch.manual_seed(0)
    spanned = torchspan.span(model, weights=lambda m: nn.init.ones_(m.scale))
    torch.manual_seed(0)
    reference = _Scaled()
    for (name, p), q in zip(spanned.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **EXACT, msg=lambda m: f"{name}: {m}")


def test_refusals(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    with pytest.raises(
        ValueError, match=r"span\(model\): the model is on the meta device \('0.weight' has a shape"
    ):
        torchspan.span(meta)
    with pytest.raises(ValueError, match=r"weights='init' is for a model built on the meta device"):
        torchspan.span(nn.Linear(2, 2), weights="init")
    with pytest.raises(ValueError, match=r"weights=3 is not one of"):
        torchspan.span(meta, weights=3)
    with pytest.raises(ValueError, match=r"weights='.*nowhere' does not exist"):
        torchspan.span(meta, weights=str(tmp_path / "nowhere"))
    with pytest.raises(
        ValueError, match=r"is not a checkpoint folder \(no .metadata\) nor a .safetensors file"
    ):
        torchspan.span(meta, weights=tmp_path)
    mixed = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    mixed[1].to("meta")
    with pytest.raises(
        ValueError, match=r"2 parameter\(s\) of the model are on meta and 2 are not \(e.g. '0.weight'\)"
    ):
        torchspan.span(mixed, weights="init")
    save_file(
        {"0.weight": torch.zeros(4, 3), "0.bias": torch.zeros(4), "1.weight": torch.zeros(2, 4)},
        str(tmp_path / "part.safetensors"),
    )
    with pytest.raises(ValueError, match=r"the checkpoint has no '1.bias'"):
        torchspan.span(meta, weights=tmp_path / "part.safetensors")
    save_file({"0.weight": torch.zeros(3, 3)}, str(tmp_path / "shape.safetensors"))
    with pytest.raises(
        ValueError, match=r"'0.weight' has shape \[3, 3\] in the file and \[4, 3\] in the model"
    ):
        torchspan.span(meta, weights=tmp_path / "shape.safetensors")
    assert all(p.is_meta for p in meta.parameters())  # refused before anything was made real
    assert torchspan.span(meta, devices=["meta"]).devices == ["meta"]  # tracing shapes needs no weights
