"""A training script with the classic device bug: the loss's class-weight buffer stays behind.

On a GPU machine the model goes to CUDA but the criterion (with its `weight` buffer) does not;
here the `meta` device stands in for the GPU so the mistake shows on any machine.

    torchspan doctor examples/loss_weight_left_behind.py
"""

import torch
from torch import nn

device = "cuda" if torch.cuda.is_available() else "meta"

model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 3)).to(device)
criterion = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5]))  # forgot criterion.to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

for step in range(3):
    x = torch.randn(8, 10, device=device)
    y = torch.randint(0, 3, (8,), device=device)
    optimizer.zero_grad()
    loss = criterion(model(x), y)
    loss.backward()
    optimizer.step()
