"""Model factories for `torchspan plan` / `torchspan verify` examples.

    torchspan plan examples/models.py:mlp --input-shape 64,1024 --devices "a100-40gb,cpu" --memory cuda:0=200MiB
"""

from torch import nn


def mlp() -> nn.Sequential:
    """Eight 1024-wide Linear+ReLU blocks and a 10-way head (about 34 MB of float32 parameters)."""
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(1024, 10))
