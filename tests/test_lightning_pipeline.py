"""Lightning's own loop on a pipeline across ranks: after a few epochs the weights are plain Lightning's on
one device.

``SpanStrategy(devices=["cpu", "cpu"], microbatches=3)`` in two gloo ranks is a 2-stage pipeline across the
ranks (each holds one stage): ``training_step``'s ``criterion(self(x), y)`` runs the pipeline's schedule
(``torchspan.lightning.staged``), ``loss.backward()`` adds its gradients. The references are plain
``L.Trainer`` runs in one process on the same global batches (23 samples in batches of 8: the last one short,
micro-batches 3+3+2 and 3+2+2), ``float64``: class-weighted cross-entropy, a padded token mean over flattened
tokens, ``accumulate_grad_batches=2``, ``gradient_clip_val``; the logged loss is the global batch's;
``ModelCheckpoint`` + ``ckpt_path=`` resume; validation and predict through the pipeline; Fabric's own loop
on the pipeline (``SpanFabricStrategy``) with ``fabric.save``/``fabric.load``; a ``training_step``
torchspan cannot read on the deferred outputs is refused, naming the way out. On four ranks: 2 stages x 2
replicas, each replica's rows uneven (4 + 4, 4 + 3).

Skipped when ``lightning`` is not installed (``pip install -e '.[lightning]'``).

Usage: ``python -m pytest -q tests/test_lightning_pipeline.py``
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning", reason="Lightning is not installed: pip install -e '.[lightning]'")

from ranks_spawn import join_job, spawn  # noqa: E402
from test_lightning import QUIET, TOL, Classifier, Tagger, _data, _fit, _loader, _same  # noqa: E402

from torchspan.lightning import SpanFabricStrategy, SpanStrategy  # noqa: E402
from torchspan.lightning.deferred import PipelineLoopError  # noqa: E402
from torchspan.runtime.ranks import free_port  # noqa: E402

PIPE = dict(devices=["cpu", "cpu"], microbatches=3)
_CASES = [
    ("classifier", Classifier, {}),
    ("tagger", Tagger, {}),
    ("accumulated", Classifier, {"accumulate_grad_batches": 2}),
    ("four-epochs", Classifier, {"epochs": 4}),
]


class Logged(Classifier):
    """Logs the loss training_step returns (the global batch's on every rank of the pipeline)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss_value", loss.detach())
        return loss


class Metric(Classifier):
    """Computes an accuracy on the training outputs: values the pipeline's deferred outputs do not have."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        self.log("acc", (out.argmax(-1) == y).float().mean())
        return self.criterion(out, y)


class Penalized(Classifier):
    """Adds a term on the outputs beside the loss: torchspan cannot weigh it per micro-batch."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        return self.criterion(out, y) + 0.1 * out.pow(2).mean()


class Mixed(Tagger):
    """Transposes the batch away from dim 0 before the loss: micro-batches would not be their rows' losses."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(
            self(x).transpose(0, 1).flatten(0, 1), y.transpose(0, 1).flatten(), ignore_index=-100
        )


def _references(folder: Path) -> None:
    """Plain Lightning on one device: the weights (and last logged losses) every pipeline must end with."""
    for name, kind, kwargs in [*_CASES, ("logged", Logged, {})]:
        lit = kind()
        trainer = _fit(lit, tokens=kind is Tagger, **kwargs) if kind is not Logged else _validated(lit)
        torch.save(
            {"state": lit.state_dict(), "metrics": dict(trainer.callback_metrics)}, folder / f"{name}.pt"
        )


def _validated(lit: L.LightningModule, strategy=None) -> L.Trainer:
    """Two epochs with a validation loader (sanity check and each epoch's validation run the eval forward)."""
    trainer = L.Trainer(
        strategy=strategy or "auto",
        **QUIET,
        max_epochs=2,
        enable_checkpointing=False,
        gradient_clip_val=0.3,
        devices=1,
    )
    trainer.fit(lit, _loader(), _loader())
    return trainer


def _load(folder: Path, name: str) -> dict:
    return torch.load(folder / f"{name}.pt", weights_only=False)


def _whole(trainer: L.Trainer, kind: type) -> L.LightningModule:
    """A plain copy of the trained module with every stage's weights (each rank holds its own stage's)."""
    plain = kind()
    plain.load_state_dict(
        trainer.strategy.lightning_module_state_dict()
    )  # a collective: every stage's entries
    return plain


def _worker(rank: int, world: int, port: int, folder: str) -> None:
    join_job(rank, world, port)
    where = Path(folder)
    for name, kind, kwargs in _CASES[:3]:
        lit = kind()
        trainer = _fit(lit, SpanStrategy(**PIPE), tokens=kind is Tagger, **kwargs)
        assert lit.model.mode in ("sequential", "fx") and lit.model.data_parallel == (0, 1), name
        assert any(p.device.type == "meta" for p in lit.parameters()), "each rank holds its own stage only"
        reference = kind()
        reference.load_state_dict(_load(where, name)["state"])
        _same(_whole(trainer, kind), reference, f"rank {rank}, pipeline across ranks, {name}")
    lit = Logged()
    trainer = _validated(lit, SpanStrategy(**PIPE))  # validation between the training epochs
    want = _load(where, "logged")
    reference = Logged()
    reference.load_state_dict(want["state"])
    _same(_whole(trainer, Logged), reference, f"rank {rank}, pipeline across ranks, validated")
    for key in (
        "loss_value",
        "train_loss",
        "val_loss",
    ):  # train_step sums the micro-batches' losses in float32
        got, wanted = float(trainer.callback_metrics[key]), float(want["metrics"][key])
        assert abs(got - wanted) < 1e-6 * abs(wanted), (rank, key, got, wanted)
    _resume(rank, where, _load(where, "four-epochs")["state"])
    _evaluate()
    _fabric(rank, where, _load(where, "classifier")["state"])
    _refusals()


def _fabric(rank: int, folder: Path, want: dict) -> None:
    """Fabric's own loop on the pipeline (the loss runs the step, fabric.backward adds its gradients): the
    Trainer's plain reference weights; fabric.save writes every stage's weights and Adam state, fabric.load
    puts them back."""
    fabric = L.Fabric(strategy=SpanFabricStrategy(**PIPE), accelerator="cpu", devices=1)
    fabric.launch()
    lit = Classifier()
    model, optimizer = fabric.setup(lit.model, torch.optim.Adam(lit.model.parameters(), lr=0.05))
    loader = fabric.setup_dataloaders(_loader())
    for _ in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            fabric.backward(lit.criterion(model(x), y))
            fabric.clip_gradients(model, optimizer, max_norm=0.3)
            optimizer.step()
    path = folder / "fabric-pipeline.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 6})
    saved = torch.load(path, weights_only=False)
    got = {f"model.{k}": v for k, v in saved["model"].items()}
    for key, value in want.items():
        if key.startswith("model."):
            torch.testing.assert_close(
                got[key], value, **TOL, msg=lambda m, key=key: f"rank {rank}, fabric: {key}: {m}"
            )
    assert len(saved["optimizer"]["state"]) == 4, "every stage's Adam state is saved"
    other = Classifier(seed=3)
    model2, optimizer2 = fabric.setup(other.model, torch.optim.Adam(other.model.parameters(), lr=0.05))
    assert fabric.load(path, {"model": model2, "optimizer": optimizer2}) == {"step": 6}
    mine = {k: v for k, v in model2.state_dict().items() if v.device.type != "meta"}
    assert mine and all(torch.equal(v, saved["model"][k]) for k, v in mine.items()), (
        "this rank's stage is loaded"
    )
    opt_state = optimizer2.state_dict()["state"]
    assert opt_state and all(
        torch.equal(s["exp_avg"], saved["optimizer"]["state"][i]["exp_avg"]) for i, s in opt_state.items()
    )


def _resume(rank: int, folder: Path, want: dict) -> None:
    """Two epochs with ModelCheckpoint (every stage's weights and optimizer state in one file), then a new
    Trainer resumes from it to four: plain Lightning's four."""
    ckpt = folder / "ckpt-pipeline"
    save = L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt, save_last=True)
    _fit(Classifier(), SpanStrategy(**PIPE), epochs=2, enable_checkpointing=True, callbacks=[save])
    saved = torch.load(ckpt / "last.ckpt", weights_only=False)
    assert all(v.device.type != "meta" for v in saved["state_dict"].values()), "a stage's weights are missing"
    assert len(saved["optimizer_states"][0]["state"]) == 4, "every stage's Adam state is saved"
    lit = Classifier(seed=5)  # other weights: the checkpoint must replace them
    trainer = L.Trainer(
        strategy=SpanStrategy(**PIPE),
        **QUIET,
        max_epochs=4,
        enable_checkpointing=False,
        gradient_clip_val=0.3,
        devices=1,
    )
    trainer.fit(lit, _loader(), ckpt_path=str(ckpt / "last.ckpt"))
    reference = Classifier()
    reference.load_state_dict(want)
    _same(_whole(trainer, Classifier), reference, f"rank {rank}, pipeline resumed")


def _evaluate() -> None:
    """Validation and predict run the pipeline's forward: one device's values on every rank."""
    lit, plain = Classifier(), Classifier()
    trainer = L.Trainer(strategy=SpanStrategy(**PIPE), **QUIET, devices=1)
    got = trainer.validate(lit, _loader())[0]["val_loss"]
    want = L.Trainer(**QUIET, devices=1).validate(plain, _loader())[0]["val_loss"]
    assert abs(got - want) < 1e-9, (got, want)
    outs = trainer.predict(lit, _loader())
    torch.testing.assert_close(torch.cat(outs), plain(_data().tensors[0]), **TOL)


def _refusals() -> None:
    for kind, match in ((Metric, "argmax"), (Penalized, "pow"), (Mixed, "mix the batch's rows")):
        with pytest.raises(PipelineLoopError, match=match):
            _fit(kind(), SpanStrategy(**PIPE), tokens=kind is Mixed)
    with pytest.raises(ValueError, match="drop shard=True"):
        _fit(Classifier(), SpanStrategy(shard=True, **PIPE))


@pytest.mark.slow
def test_two_ranks_pipeline_is_plain_lightning(tmp_path: Path) -> None:
    _references(tmp_path)
    spawn(_worker, 2, free_port(), str(tmp_path), deadline=400.0)


def _replicas(rank: int, world: int, port: int, folder: str) -> None:
    join_job(rank, world, port)
    for name, kind, kwargs in _CASES[:2]:
        lit = kind()
        trainer = _fit(lit, SpanStrategy(**PIPE), tokens=kind is Tagger, **kwargs)
        assert lit.model.data_parallel == (rank // 2, 2), (rank, lit.model.data_parallel)
        reference = kind()
        reference.load_state_dict(_load(Path(folder), name)["state"])
        _same(_whole(trainer, kind), reference, f"rank {rank}, 2 stages x 2 replicas, {name}")


@pytest.mark.slow
def test_four_ranks_pipeline_replicas_are_plain_lightning(tmp_path: Path) -> None:
    _references(tmp_path)
    spawn(_replicas, 4, free_port(), str(tmp_path), deadline=400.0)
