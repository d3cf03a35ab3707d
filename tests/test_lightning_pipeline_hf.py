"""A transformers model on a pipeline across ranks under Lightning's own loop, as users write it.

A tiny GPT-2 (its embedding and head tied, float64) in a ``LightningModule``: ``SpanStrategy(devices=["cpu",
"cpu"], microbatches=2)`` on two gloo ranks runs it through the model's own forward (``mode ==
"own-forward"``), each rank one stage. Two ``training_step``s users write: cross-entropy on shifted logits
with padded labels (``ignore_index=-100``), and the model's own loss, ``self.model(**batch).loss``, logged and
returned (with ``accumulate_grad_batches`` 1 and 2). 11 sequences in batches of 4 (the last one 3 rows, 2 + 1
micro-batches), every row a different number of real tokens. The weights after two epochs equal plain
Lightning's on one device (1e-9), and the logged loss its value. Adding another output to the model's own loss
is refused. Fabric's own loop, ``fabric.backward(model(**batch).loss)``, ends with the same weights.

Usage: ``python -m pytest -q tests/test_lightning_pipeline_hf.py``
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning", reason="Lightning is not installed: pip install -e '.[lightning]'")
transformers = pytest.importorskip("transformers", reason="pip install -e '.[hf]'")

from ranks_spawn import join_job, spawn  # noqa: E402
from test_lightning import QUIET  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from torchspan.lightning import SpanFabricStrategy, SpanStrategy  # noqa: E402
from torchspan.lightning.deferred import PipelineLoopError  # noqa: E402
from torchspan.runtime.ranks import free_port  # noqa: E402

VOCAB, LENGTH = 50, 8


class Shifted(L.LightningModule):
    """Cross-entropy of each next token from the logits, padding (label -100) ignored."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0, eos_token_id=0
        )
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
        self.model = transformers.GPT2LMHeadModel(config).double()

    def training_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch["input_ids"]).logits
        labels = batch["labels"]
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


class Own(Shifted):
    """The model's own loss, as a transformers user writes it."""

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss


class Penalized(Shifted):
    def training_step(self, batch, batch_idx):
        out = self.model(**batch)
        return out.loss + 0.1 * out.logits.pow(2).mean()


class _Tokens(Dataset):
    """11 sequences; row i has 3 + i % 5 real tokens, the rest padding (label -100)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, VOCAB, (11, LENGTH), generator=g)
        self.labels = self.ids.clone()
        for i in range(11):
            self.labels[i, 3 + i % 5 :] = -100

    def __len__(self) -> int:
        return 11

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _fit(lit: L.LightningModule, strategy=None, accumulate: int = 1) -> L.Trainer:
    trainer = L.Trainer(
        strategy=strategy or "auto",
        **QUIET,
        max_epochs=2,
        enable_checkpointing=False,
        devices=1,
        accumulate_grad_batches=accumulate,
    )
    trainer.fit(lit, DataLoader(_Tokens(), batch_size=4))
    return trainer


_CASES = [("shifted", Shifted, 1), ("own", Own, 1), ("own-accumulated", Own, 2)]
EXACT = dict(rtol=1e-9, atol=1e-11)
# transformers' own loss casts the logits to float32 (``ForCausalLMLoss``): the micro-batches' sums round
# there, in another order than the whole batch's; an update moves the weights by more than 1e-3
OWN = dict(rtol=1e-5, atol=1e-7)


def _worker(rank: int, world: int, port: int, folder: str) -> None:
    join_job(rank, world, port)
    for name, kind, accumulate in _CASES:
        lit = kind()
        trainer = _fit(lit, SpanStrategy(devices=["cpu", "cpu"], microbatches=2), accumulate)
        assert lit.model.mode == "own-forward" and lit.model.data_parallel == (0, 1), name
        whole = kind()
        whole.load_state_dict(trainer.strategy.lightning_module_state_dict())
        want = torch.load(Path(folder) / f"{name}.pt", weights_only=False)
        tol = EXACT if kind is Shifted else OWN
        for key, value in want["state"].items():
            got = whole.state_dict()[key]
            torch.testing.assert_close(got, value, **tol, msg=lambda m, k=key: f"{name}: {k}: {m}")
        moved = max(float((v - kind().state_dict()[k]).abs().max()) for k, v in want["state"].items())
        assert moved > 1e-3, f"{name}: the reference did not train"
        got, wanted = float(trainer.callback_metrics["train_loss"]), float(want["loss"])
        assert abs(got - wanted) < 1e-6 * abs(wanted), (name, got, wanted)
    with pytest.raises(PipelineLoopError, match="training_step"):
        _fit(Penalized(), SpanStrategy(devices=["cpu", "cpu"], microbatches=2))
    _fabric(torch.load(Path(folder) / "own.pt", weights_only=False)["state"])


def _fabric(want: dict) -> None:
    """Fabric's own loop on the pipeline with the model's own loss: ``fabric.backward(model(**batch).loss)``
    runs the step; this rank's stage ends as plain Lightning's run of ``Own``."""
    fabric = L.Fabric(
        strategy=SpanFabricStrategy(devices=["cpu", "cpu"], microbatches=2), accelerator="cpu", devices=1
    )
    fabric.launch()
    lit = Own()
    model, optimizer = fabric.setup(lit.model, torch.optim.SGD(lit.model.parameters(), lr=0.2))
    for _ in range(2):
        for batch in fabric.setup_dataloaders(DataLoader(_Tokens(), batch_size=4)):
            optimizer.zero_grad()
            fabric.backward(model(**batch).loss)
            optimizer.step()
    held = {f"model.{k}": v for k, v in lit.model.state_dict().items() if v.device.type != "meta"}
    assert held and len(held) < len(want)
    for key, value in held.items():
        torch.testing.assert_close(value, want[key], **OWN, msg=lambda m, k=key: f"fabric: {k}: {m}")


def test_gpt2_pipeline_across_ranks_is_plain_lightning(tmp_path: Path) -> None:
    for name, kind, accumulate in _CASES:
        lit = kind()
        trainer = _fit(lit, accumulate=accumulate)
        state = {"state": lit.state_dict(), "loss": trainer.callback_metrics["train_loss"]}
        torch.save(state, tmp_path / f"{name}.pt")
    spawn(_worker, 2, free_port(), str(tmp_path))
