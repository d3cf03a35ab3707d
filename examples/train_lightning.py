"""A LightningModule trained by ``lightning.pytorch.Trainer`` on torchspan, beside plain Lightning on one
device.

The same script, the same global batches (a DataLoader's ``batch_size`` is the global batch), the same losses
and weights as plain Lightning: the loss is class-weighted cross-entropy with padded labels
(``ignore_index=-1``), the last batch is short (45 samples in batches of 10: 5 rows, 3 + 2 over two ranks),
and gradients are clipped by the whole model's norm.

Usage::

    # one process: a 2-stage local pipeline
    python examples/train_lightning.py
    # --span dp: exact replicas (the default launched)
    torchspan launch --nproc-per-node 2 examples/train_lightning.py
    torchspan launch --nproc-per-node 2 examples/train_lightning.py --span shard
    torchspan launch --nproc-per-node 2 examples/train_lightning.py --span pipeline   # 2 stages, one per rank
    # Lightning's own launcher starts the 2 processes
    python examples/train_lightning.py --span dp --devices 2

``--span pipeline`` launched is a pipeline across the ranks (each holds one stage): ``training_step``'s loss
runs its schedule (``torchspan.lightning.staged``), 4 micro-batches of each global batch, and
``loss.backward()`` adds the step's gradients; each rank steps its own stage's parameters.
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchspan.lightning import SpanStrategy

SAMPLES, FEATURES, CLASSES, PAD = 45, 16, 5, -1


class Classifier(L.LightningModule):
    """What a Lightning user writes: the loss on ``self(x)`` inside ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(
            nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, CLASSES)
        )
        self.criterion = nn.CrossEntropyLoss(weight=torch.linspace(0.5, 2.0, CLASSES), ignore_index=PAD)
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.criterion(self(x), y)  # on torchspan: the whole global batch's loss, on every rank
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_train_epoch_end(self) -> None:
        self.losses.append(float(self.trainer.callback_metrics["train_loss"]))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    y[torch.rand(SAMPLES, generator=g) < 0.2] = PAD
    return DataLoader(TensorDataset(x, y), batch_size=10)  # the global batch, as on one device


def fit(strategy, devices, epochs: int) -> Classifier:
    lit = Classifier()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=epochs,
        gradient_clip_val=1.0,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(lit, loader())
    return lit


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    parser.add_argument(
        "--span", choices=("dp", "shard", "pipeline"), default="dp" if launched else "pipeline"
    )
    parser.add_argument(
        "--devices", default="auto", help="Trainer(devices=): processes; 2 starts Lightning's own launcher"
    )
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    devices = int(args.devices) if args.devices.isdigit() else args.devices
    plain = fit("auto", 1, args.epochs)  # plain Lightning on one device, in this process
    options = {
        "dp": {},
        "shard": {"shard": True},
        "pipeline": {"devices": ["cpu", "cpu"], "microbatches": 4},
    }[args.span]
    try:
        spanned = fit(SpanStrategy(**options), devices, args.epochs)
    except ValueError as err:
        print(f"train_lightning.py: {err}", file=sys.stderr)
        return 2
    strategy = spanned.trainer.strategy
    state, reference = strategy.lightning_module_state_dict(), plain.state_dict()  # a pipeline: every stage's
    diff = max(float((state[k] - reference[k]).abs().max()) for k in reference)
    if strategy.is_global_zero:
        print(
            f"torchspan {args.span}: mode={strategy.spanned.mode} on "
            f"{', '.join(strategy.spanned.devices)}, {strategy.world_size} process(es)"
        )
        for epoch, (a, b) in enumerate(zip(spanned.losses, plain.losses), 1):
            print(f"epoch {epoch}: loss {a:.6f} on torchspan, {b:.6f} plain Lightning on one device")
        print(f"largest weight difference from plain Lightning: {diff:.3e}")
    return 0 if diff < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
