"""A transformers decoder with tied embeddings trained as a pipeline across processes, untraced.

Each rank holds one stage of a small random-init Llama (its blocks; the tied embedding on both end
stages), runs the model's own forward with the other stages on ``meta``, and trains it with a
token-mean cross-entropy over padded batches under 1F1B. The weights after training equal plain
PyTorch training of the whole model in one process (``--reference``).

Usage::

    torchspan launch --nproc-per-node 2 examples/train_pipeline_hf.py --steps 4
    torchspan launch --nproc-per-node 4 examples/train_pipeline_hf.py --stages 2   # 2 replicas x 2 stages
    python examples/train_pipeline_hf.py --reference                              # one process, plain PyTorch
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import transformers

import torchspan
from torchspan.runtime.ranks import init_distributed, shard_batch

VOCAB, PAD = 64, -100


def make_model(dtype: torch.dtype) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype)


def make_batch(step: int, rows: int, length: int) -> dict[str, torch.Tensor]:
    """The same batch on every rank (seeded by step); right padding masked in the input and the labels."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (rows, length), generator=g)
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=g)
    mask = (torch.arange(length) < lengths[:, None]).long()
    labels = ids.roll(-1, dims=1).masked_fill(mask == 0, PAD)
    labels[:, -1] = PAD
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def token_loss(out, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), ignore_index=PAD)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=6, help="global batch size (rows)")
    parser.add_argument("--length", type=int, default=12, help="tokens per row")
    parser.add_argument(
        "--stages", type=int, default=0, help="pipeline stages (default: every process is one stage)"
    )
    parser.add_argument("--microbatches", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--reference", action="store_true", help="plain PyTorch in this one process")
    parser.add_argument(
        "--out", default=None, help="each rank writes the parameters it holds and the losses here (.rankN)"
    )
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    model = make_model(dtype)
    if args.reference:
        rank, module = 0, model
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        step_fn = lambda b: token_loss(
            model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]), b["labels"]
        )  # noqa: E731
    else:
        info = init_distributed()
        stages = args.stages or info.world_size
        replicas = info.world_size // stages
        rank, replica = info.rank, info.rank // stages
        spanned = torchspan.span(
            model, devices=["cpu"] * stages, microbatches=args.microbatches, schedule="1f1b"
        )
        module = spanned.module
        optimizer = torch.optim.Adam(
            spanned.parameters(), lr=1e-2
        )  # this rank's stage (tied embedding included)

        def step_fn(b: dict[str, torch.Tensor]) -> torch.Tensor:
            mine = shard_batch(b, replica, replicas)  # this replica's rows; every stage of it gets the same
            inputs = {"input_ids": mine["input_ids"], "attention_mask": mine["attention_mask"]}
            return spanned.train_step(
                inputs, mine["labels"], token_loss, loss_normalizer=lambda y: (y != PAD).sum()
            )

    losses = []
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = step_fn(make_batch(step, args.batch, args.length))
        if args.reference:
            loss.backward()
        optimizer.step()
        losses.append(float(loss))
        if rank == 0:
            print(f"step {step + 1}/{args.steps} loss {float(loss):.5f}")
    if args.out:
        held = {n: p.detach().clone() for n, p in module.named_parameters() if p.device.type != "meta"}
        torch.save({"params": held, "losses": losses}, f"{args.out}.rank{rank}")


if __name__ == "__main__":
    main()
