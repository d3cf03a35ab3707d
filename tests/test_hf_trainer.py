"""transformers' ``Trainer`` on torchspan, checked against plain single-process ``Trainer`` on the same global
batch.

A tied-embedding Llama on 11 padded rows (global batch 8 over 2 accumulation steps: 8 + 3 rows, so the second
micro-step is short and uneven over replicas), clipped by ``max_grad_norm``, one SGD step: the weights saved
by ``save_model`` (loaded with ``from_pretrained``) and ``eval_loss`` must equal plain ``Trainer``'s
(float32: the same sums in another order). In one process: the stock ``Trainer`` given ``span(...)`` and
``torchspan.hf.Trainer(span=...)``; on 2 gloo ranks: replicas, sharded replicas and a 2-stage pipeline, and a
checkpoint resumed bit-identically.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the hf extra (transformers, accelerate) is not installed"
)
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (the hf extra)")

from ranks_spawn import join_job, spawn  # noqa: E402

import torchspan  # noqa: E402
import torchspan.hf  # noqa: E402
from torchspan.runtime.ranks import free_port  # noqa: E402

TOL = dict(rtol=1e-5, atol=2e-7)  # float32 sums in another order; an update is ~1e-2


def _config():
    return transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )


def _model():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(_config())


class Rows(torch.utils.data.Dataset):
    """``n`` rows of 8 tokens, every third padded by 3 and every fourth from the second by 6 (labels -100)."""

    def __init__(self, n: int = 11) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, 40, (n, 8), generator=g)
        self.mask = torch.ones(n, 8, dtype=torch.long)
        self.mask[::3, -3:] = 0
        self.mask[1::4, -6:] = 0

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.ids[i],
            "attention_mask": self.mask[i],
            "labels": self.ids[i].masked_fill(self.mask[i] == 0, -100),
        }


def _args(out: str, batch: int, **more):
    options = dict(
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=0.3,
        optim="sgd",
        learning_rate=0.5,
        num_train_epochs=1,
        lr_scheduler_type="constant",
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    options.update(more)
    return transformers.TrainingArguments(out, **options)


def _plain(out: Path, batch: int) -> tuple[dict[str, torch.Tensor], float, Any]:
    """Plain single-process Trainer on the same global batch: its weights, eval_loss and predictions."""
    model = _model()
    trainer = transformers.Trainer(
        model=model, args=_args(str(out), batch), train_dataset=Rows(), eval_dataset=Rows(6)
    )
    trainer.train()
    return model.state_dict(), trainer.evaluate()["eval_loss"], trainer.predict(Rows(6)).predictions


def _same(
    folder: Path,
    eval_loss: float,
    want: tuple[dict[str, torch.Tensor], float, Any],
    label: str,
    predictions: Any = None,
) -> None:
    saved = transformers.LlamaForCausalLM.from_pretrained(folder).state_dict()
    start = _model().state_dict()
    for name, value in want[0].items():
        assert not torch.equal(value, start[name]) or "rotary" in name, f"{label}: {name} did not train"
        torch.testing.assert_close(saved[name], value, **TOL, msg=lambda m: f"{label}: {name}: {m}")
    assert eval_loss == pytest.approx(want[1], rel=1e-6), label
    if predictions is not None:  # every row once, in order, as plain Trainer gathers them
        assert predictions.shape == want[2].shape, (label, predictions.shape, want[2].shape)
        torch.testing.assert_close(
            torch.as_tensor(predictions), torch.as_tensor(want[2]), rtol=1e-4, atol=1e-5
        )


def test_trainers_in_one_process_match_plain_trainer(tmp_path: Path) -> None:
    want = _plain(tmp_path / "plain", 4)
    spanned = torchspan.span(_model(), devices=["cpu", "cpu"], microbatches=2)
    stock = transformers.Trainer(
        model=spanned, args=_args(str(tmp_path / "stock"), 4), train_dataset=Rows(), eval_dataset=Rows(6)
    )
    stock.train()
    spanned.module.save_pretrained(tmp_path / "stock" / "final")
    _same(
        tmp_path / "stock" / "final",
        stock.evaluate()["eval_loss"],
        want,
        "transformers.Trainer(model=span(...))",
    )
    ours = torchspan.hf.Trainer(
        model=_model(),
        args=_args(str(tmp_path / "ours"), 4),
        train_dataset=Rows(),
        eval_dataset=Rows(6),
        span={"devices": ["cpu", "cpu"], "microbatches": 2},
    )
    ours.train()
    ours.save_model(str(tmp_path / "ours" / "final"))
    _same(
        tmp_path / "ours" / "final", ours.evaluate()["eval_loss"], want, "torchspan.hf.Trainer, one process"
    )


LAYOUTS = {"dp": {}, "shard": {"shard": True}, "pipeline": {"balance": [4, 4], "microbatches": 2}}


def _job(rank: int, world: int, port: int, out: str) -> None:
    join_job(rank, world, port)
    for layout, span in LAYOUTS.items():
        folder = Path(out) / layout
        trainer = torchspan.hf.Trainer(
            model=_model(), args=_args(str(folder), 4), train_dataset=Rows(), eval_dataset=Rows(6), span=span
        )
        assert trainer.spanned.mode == {"dp": "data-parallel", "shard": "sharded"}.get(
            layout, "own-forward"
        ), layout
        trainer.train()
        loss = trainer.evaluate()["eval_loss"]
        trainer.save_model(str(folder / "final"))
        predictions = trainer.predict(Rows(6)).predictions
        if rank == 0:
            (folder / "eval.json").write_text(json.dumps(loss))
            torch.save(torch.as_tensor(predictions), folder / "predictions.pt")
    for layout in ("shard", "pipeline"):
        _resume(rank, Path(out) / f"resume-{layout}", LAYOUTS[layout])


def _resume(rank: int, folder: Path, span: dict) -> None:
    """Three steps straight, or one step, a checkpoint, and two more from it: the same bits."""

    def run(out: Path, steps: int, resume: str | None = None) -> dict[str, torch.Tensor]:
        args = _args(
            str(out),
            4,
            max_steps=steps,
            save_strategy="steps",
            save_steps=1,
            gradient_accumulation_steps=1,
            optim="adamw_torch",
            learning_rate=1e-2,
        )
        trainer = torchspan.hf.Trainer(model=_model(), args=args, train_dataset=Rows(21), span=span)
        trainer.train(resume_from_checkpoint=resume)
        return torchspan.hf.full_state_dict(trainer.spanned)

    straight = run(folder / "straight", 3)
    run(folder / "halves", 1)
    resumed = run(folder / "halves", 3, resume=str(folder / "halves" / "checkpoint-1"))
    different = [k for k in straight if not torch.equal(straight[k], resumed[k])]
    assert not different, f"rank {rank}, {folder.name}: resumed weights differ at {different[:3]}"


def _spawn(fn, world: int, *args, deadline: float = 300.0) -> None:
    spawn(fn, world, *args, deadline=deadline)


@pytest.mark.slow
def test_launched_trainer_matches_plain_trainer(tmp_path: Path) -> None:
    _spawn(_job, 2, free_port(), str(tmp_path))
    for layout in LAYOUTS:
        replicas = 1 if layout == "pipeline" else 2
        want = _plain(tmp_path / f"plain-{layout}", 4 * replicas)
        loss = json.loads((tmp_path / layout / "eval.json").read_text())
        predictions = torch.load(tmp_path / layout / "predictions.pt")
        _same(tmp_path / layout / "final", loss, want, f"2 ranks, {layout}", predictions)


def test_bad_input_is_refused_before_training(tmp_path: Path) -> None:
    def make(**more):
        return torchspan.hf.Trainer(
            model=_model(), args=_args(str(tmp_path), 4), train_dataset=Rows(), **more
        )

    with pytest.raises(ValueError, match="torchspan.span takes no microbatch"):
        make(span={"microbatch": 2})
    with pytest.raises(ValueError, match="per_device_train_batch_size=4 < span microbatches=8"):
        make(span={"devices": ["cpu", "cpu"], "microbatches": 8})
    with pytest.raises(ValueError, match="pass the plain model"):
        torchspan.hf.Trainer(model=torchspan.span(_model()), args=_args(str(tmp_path), 4), span={})
    with pytest.raises(TypeError, match="is not a dict of torchspan.span keyword arguments"):
        make(span=["cpu"])
    args = _args(str(tmp_path), 4)
    args.fsdp = "full_shard"
    with pytest.raises(ValueError, match="both would shard the model"):
        torchspan.hf.Trainer(model=_model(), args=args, train_dataset=Rows(), span={"shard": True})
    assert copy.copy(torchspan.hf.span_options({"shard": True})) == (None, {"shard": True})


def test_span_auto_plans_from_a_training_batch(tmp_path: Path) -> None:
    trainer = torchspan.hf.Trainer(
        model=_model(), args=_args(str(tmp_path), 4), train_dataset=Rows(), span="auto"
    )
    assert (
        trainer.spanned.devices and trainer.spanned.balance[0] >= 1
    )  # the planner's placement on this machine
    trainer.train()
    with pytest.raises(ValueError, match="pass train_dataset="):
        torchspan.hf.Trainer(model=_model(), args=_args(str(tmp_path), 4), span="auto")
