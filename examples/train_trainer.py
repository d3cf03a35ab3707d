"""transformers' Trainer on torchspan: a small Llama on generated text, its loss beside plain Trainer's.

Run with::

    python examples/train_trainer.py                                  # one process: a pipeline over cpu, cpu
    torchspan launch --nproc-per-node 2 examples/train_trainer.py --span dp        # replicas
    torchspan launch --nproc-per-node 2 examples/train_trainer.py --span shard     # sharded replicas (FSDP2)
    torchspan launch --nproc-per-node 2 examples/train_trainer.py --span pipeline  # one stage per process

Each prints, per optimizer step, torchspan's loss and plain single-process ``transformers.Trainer``'s on the
same global batches (run in a fresh process of its own, ``--plain``): they agree to float32 rounding.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import transformers

import torchspan
import torchspan.hf

LAYOUTS = {
    "local": {"devices": ["cpu", "cpu"], "microbatches": 2},
    "dp": {},
    "shard": {"shard": True},
    "pipeline": {"microbatches": 2},
}


class Text(torch.utils.data.Dataset):
    """Generated 'sentences': token runs that repeat with a period, padded to 32 tokens (labels -100 on
    padding)."""

    def __init__(self, rows: int = 60, length: int = 32) -> None:
        g = torch.Generator().manual_seed(0)
        self.rows = []
        for _ in range(rows):
            period = int(torch.randint(2, 6, (1,), generator=g))
            ids = torch.randint(3, 200, (period,), generator=g).repeat(length // period + 1)[:length]
            keep = int(torch.randint(length // 2, length + 1, (1,), generator=g))
            mask = (torch.arange(length) < keep).long()
            self.rows.append(
                {"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
            )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def model() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(config)


def arguments(out: str, batch: int) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        out,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=2,
        max_grad_norm=1.0,
        learning_rate=3e-3,
        num_train_epochs=2,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )


def losses(trainer: transformers.Trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def plain(batch: int) -> list[float]:
    """Plain single-process Trainer on global batches of ``batch`` rows."""
    with tempfile.TemporaryDirectory() as out:
        trainer = transformers.Trainer(model=model(), args=arguments(out, batch), train_dataset=Text())
        trainer.train()
        return losses(trainer)


def plain_in_a_process(batch: int) -> list[float]:
    """``plain`` in a fresh process, outside the launched job (Trainer would join it otherwise)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "TORCHELASTIC_RUN_ID",
            "GROUP_RANK",
            "ROLE_RANK",
            "ROLE_WORLD_SIZE",
        )
    }
    done = subprocess.run(
        [sys.executable, __file__, "--plain", str(batch)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--span",
        choices=sorted(LAYOUTS),
        default=None,
        help="how to span the model (default: local in one process, dp launched)",
    )
    parser.add_argument("--plain", type=int, default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.plain is not None:
        print(json.dumps(plain(opts.plain)))
        return
    info = torchspan.init_distributed()
    layout = opts.span or ("dp" if info.world_size > 1 else "local")
    span = dict(LAYOUTS[layout])
    if layout == "pipeline":
        span["devices"] = ["cpu"] * info.world_size
    with tempfile.TemporaryDirectory() as out:
        trainer = torchspan.hf.Trainer(model=model(), args=arguments(out, 4), train_dataset=Text(), span=span)
        trainer.train()
        ours = losses(trainer)
    replicas = trainer.spanned.data_parallel[1]
    if info.is_main:
        theirs = plain_in_a_process(4 * replicas)
        print(
            f"torchspan.hf.Trainer, {layout} ({trainer.spanned.mode}) on {info.world_size} process(es), "
            f"global batch {4 * replicas} x 2 accumulated"
        )
        for step, (a, b) in enumerate(zip(ours, theirs), 1):
            print(f"step {step:2d}: loss {a:.4f}  plain Trainer {b:.4f}")
        same = all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(ours, theirs)) and len(ours) == len(theirs)
        print("the same losses as plain Trainer" if same else "DIFFERENT from plain Trainer")


if __name__ == "__main__":
    main()
