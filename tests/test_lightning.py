"""Lightning on torchspan (``torchspan.lightning``): after a few epochs the weights are plain Lightning's on
one device.

A plain ``L.Trainer`` (one process, ``float64``) trains each model on the same global batches (23 samples in
batches of 8: the last one short, 4 + 3 rows over two ranks); ``SpanStrategy`` trains a copy from the same
weights in one process as a local pipeline, and in two gloo ranks on 127.0.0.1 (``torch.multiprocessing``, as
``tests/test_plain_loop.py``) as replicas and as sharded replicas; ``SpanFabricStrategy`` trains with Fabric's
loop on two ranks. Two losses: class-weighted cross-entropy, and a padded token mean (``ignore_index=-100``,
a different number of tokens in every row). Also: ``gradient_clip_val``, ``accumulate_grad_batches``,
``sync_dist`` logging, validation/predict on whole batches, ``ModelCheckpoint`` + ``ckpt_path=`` resume, and
the refusals (fp16, unknown keys, a sharded pipeline across ranks, ``Trainer(devices=)`` against the job's
size).
A pipeline across ranks: ``tests/test_lightning_pipeline.py``.

Skipped when ``lightning`` is not installed (``pip install -e '.[lightning]'``).

Usage: ``python -m pytest -q tests/test_lightning.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

L = pytest.importorskip("lightning", reason="Lightning is not installed: pip install -e '.[lightning]'")
from ranks_spawn import spawn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import torchspan  # noqa: E402
from torchspan.lightning import SpanFabricStrategy, SpanStrategy  # noqa: E402
from torchspan.runtime.ranks import free_port  # noqa: E402

TOL = dict(rtol=1e-9, atol=1e-11)
QUIET = dict(accelerator="cpu", enable_progress_bar=False, logger=False, enable_model_summary=False)
WEIGHTS = [0.5, 2.0, 1.0, 3.0]


class Classifier(L.LightningModule):
    """Class-weighted cross-entropy on ``self.model``'s outputs, as a user writes it."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4)).double()
        self.criterion = nn.CrossEntropyLoss(weight=torch.tensor(WEIGHTS, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.criterion(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", self.criterion(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


class Tagger(Classifier):
    """A token mean over padded sequences: ``F.cross_entropy(..., ignore_index=-100)`` on flattened tokens."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten(), ignore_index=-100)


def _data(tokens: bool = False) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    if not tokens:
        return TensorDataset(
            torch.randn(23, 5, generator=g, dtype=torch.float64), torch.randint(0, 4, (23,), generator=g)
        )
    x = torch.randn(23, 6, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (23, 6), generator=g)
    lengths = torch.randint(1, 7, (23,), generator=g)
    y[torch.arange(6)[None, :] >= lengths[:, None]] = -100  # padding: a different token count in every row
    return TensorDataset(x, y)


def _loader(tokens: bool = False) -> DataLoader:
    return DataLoader(_data(tokens), batch_size=8)  # the global batch: 8, 8, 7 rows


def _fit(lit: L.LightningModule, strategy=None, tokens: bool = False, epochs: int = 2, **kwargs) -> L.Trainer:
    settings = dict(QUIET, max_epochs=epochs, enable_checkpointing=False, gradient_clip_val=0.3, devices=1)
    settings.update(kwargs)
    trainer = L.Trainer(strategy=strategy if strategy is not None else "auto", **settings)
    trainer.fit(lit, _loader(tokens))
    return trainer


def _same(lit: L.LightningModule, reference: L.LightningModule, label: str, tol=TOL) -> None:
    got, want = lit.state_dict(), reference.state_dict()
    assert sorted(got) == sorted(want), f"{label}: keys {sorted(got)} != {sorted(want)}"
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, **tol, msg=lambda m: f"{label}: {key}: {m}")
    moved = max(float((value - Classifier().state_dict()[key]).abs().max()) for key, value in want.items())
    assert moved > 1e-3, f"{label}: the reference did not train"


def _references(folder: Path) -> None:
    """Plain Lightning on one device: the weights every span must end with."""
    for name, kind, kwargs in _CASES:
        lit = kind()
        _fit(lit, tokens=kind is Tagger, **kwargs)
        torch.save(lit.state_dict(), folder / f"{name}.pt")


_CASES = [
    ("classifier", Classifier, {}),
    ("tagger", Tagger, {}),
    ("accumulated", Classifier, {"accumulate_grad_batches": 2}),
    ("four-epochs", Classifier, {"epochs": 4}),
]


# ---------------------------------------------------------------------- one process


def test_one_process_local_pipeline_is_plain_lightning(tmp_path: Path) -> None:
    _references(tmp_path)
    for name, kind, kwargs in _CASES[:3]:
        lit = kind()
        _fit(lit, SpanStrategy(devices=["cpu", "cpu"], microbatches=3), tokens=kind is Tagger, **kwargs)
        assert lit.model.mode in ("sequential", "fx") and len(lit.model.devices) == 2, name
        reference = kind()
        reference.load_state_dict(torch.load(tmp_path / f"{name}.pt"))
        _same(lit, reference, f"local pipeline, {name}")


def test_refusals_before_training() -> None:
    with pytest.raises(ValueError, match="'micro_batches' is not an argument of torchspan.span"):
        SpanStrategy(micro_batches=4)
    with pytest.raises(ValueError, match="bf16-mixed"):
        _fit(
            Classifier(), SpanStrategy(), precision="16-true"
        )  # CPU: Lightning itself turns 16-mixed into bf16-mixed
    with pytest.raises(ValueError, match="module='model'"):
        _fit(_TwoModules(), SpanStrategy())
    with pytest.raises(ValueError, match="has no module 'net'"):
        _fit(Classifier(), SpanStrategy(module="net"))


class _TwoModules(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 4).double()

    def forward(self, x):
        return self.head(self.model(x))


# ---------------------------------------------------------------------- two ranks


def _worker(rank: int, world: int, port: int, folder: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    torchspan.init_distributed(timeout=60)
    refs = {name: torch.load(Path(folder) / f"{name}.pt") for name, _, _ in _CASES}
    for shard in (False, True):
        mode = "sharded" if shard else "data-parallel"
        for name, kind, kwargs in _CASES[:3]:
            lit = kind()
            _fit(lit, SpanStrategy(shard=shard), tokens=kind is Tagger, **kwargs)
            assert lit.model.mode == mode
            reference = kind()
            reference.load_state_dict(refs[name])
            _same(lit, reference, f"rank {rank}, {mode}, {name}")
    _resume(rank, Path(folder), refs["four-epochs"])
    _evaluate(rank)
    _fabric(rank, refs["classifier"])
    _refusals(rank)


def _resume(rank: int, folder: Path, want: dict) -> None:
    """Two epochs with ModelCheckpoint, then a new Trainer resumes from its file to four: plain Lightning's
    four."""
    for shard in (False, True):
        where = folder / f"ckpt-{shard}"
        save = L.pytorch.callbacks.ModelCheckpoint(dirpath=where, save_last=True)
        _fit(Classifier(), SpanStrategy(shard=shard), epochs=2, enable_checkpointing=True, callbacks=[save])
        saved = torch.load(where / "last.ckpt", weights_only=False)
        assert "model.0.weight" in saved["state_dict"] and saved["state_dict"]["model.0.weight"].shape == (
            8,
            5,
        )
        lit = Classifier(seed=5)  # other weights: the checkpoint must replace them
        trainer = L.Trainer(
            strategy=SpanStrategy(shard=shard),
            **QUIET,
            max_epochs=4,
            enable_checkpointing=False,
            gradient_clip_val=0.3,
            devices=1,
        )
        trainer.fit(lit, _loader(), ckpt_path=str(where / "last.ckpt"))
        reference = Classifier()
        reference.load_state_dict(want)
        _same(lit, reference, f"rank {rank}, resumed, shard={shard}")


def _evaluate(rank: int) -> None:
    """Validation logs and predictions are one device's on every rank (whole batches)."""
    lit, plain = Classifier(), Classifier()
    trainer = L.Trainer(strategy=SpanStrategy(), **QUIET, devices=1)
    got = trainer.validate(lit, _loader())[0]["val_loss"]
    want = L.Trainer(**QUIET, devices=1).validate(plain, _loader())[0]["val_loss"]
    assert abs(got - want) < 1e-9, (got, want)
    outs = trainer.predict(lit, _loader())
    torch.testing.assert_close(torch.cat(outs), plain(_data().tensors[0]), **TOL)


def _fabric(rank: int, want: dict) -> None:
    """Fabric's own loop on replicas: the same weights as the Trainer's plain reference, save/load round
    trip."""
    fabric = L.Fabric(strategy=SpanFabricStrategy(), accelerator="cpu", devices=1)
    fabric.launch()
    lit = Classifier()
    model, optimizer = fabric.setup(lit.model, torch.optim.Adam(lit.model.parameters(), lr=0.05))
    criterion = lit.criterion
    loader = fabric.setup_dataloaders(_loader())
    for _ in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            fabric.backward(criterion(model(x), y))
            fabric.clip_gradients(model, optimizer, max_norm=0.3)
            optimizer.step()
    got = {f"model.{k}": v for k, v in model.state_dict().items()}
    for key, value in want.items():
        if key.startswith("model."):
            torch.testing.assert_close(
                got[key], value, **TOL, msg=lambda m: f"rank {rank}, fabric: {key}: {m}"
            )
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"torchspan-fabric-{os.environ['MASTER_PORT']}.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 6})
    other = Classifier(seed=3)
    model2, optimizer2 = fabric.setup(other.model, torch.optim.Adam(other.model.parameters(), lr=0.05))
    rest = fabric.load(path, {"model": model2, "optimizer": optimizer2})
    assert rest == {"step": 6} or rest.get("step") == 6, rest
    for key, value in model.state_dict().items():
        torch.testing.assert_close(model2.state_dict()[key], value, **TOL)
    fabric.barrier()
    if rank == 0:
        path.unlink()


def _refusals(rank: int) -> None:
    fabric = L.Fabric(
        strategy=SpanFabricStrategy(devices=["cpu", "cpu"], shard=True), accelerator="cpu", devices=1
    )
    fabric.launch()
    lit = Classifier()
    with pytest.raises(ValueError, match="sharded pipeline across ranks.*drop shard=True"):
        fabric.setup(lit.model, torch.optim.Adam(lit.model.parameters()))
    with pytest.raises(ValueError, match=r"devices=3.*WORLD_SIZE=2"):
        _fit(Classifier(), SpanStrategy(), devices=3)


def _spawn(fn, world: int, *args, deadline: float = 300.0) -> None:
    spawn(fn, world, *args, deadline=deadline)


@pytest.mark.slow
def test_two_ranks_replicas_sharded_fabric_and_resume_are_plain_lightning(tmp_path: Path) -> None:
    _references(tmp_path)
    _spawn(_worker, 2, free_port(), str(tmp_path))
