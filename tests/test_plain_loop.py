"""The loop users already write, ``loss = criterion(spanned(x), y); loss.backward()``, on launched ranks.

Two gloo ranks on 127.0.0.1 each hold their rows of an 11-row batch (6 + 5, or 11 + 0 for an empty
shard) and run the plain loop on ``torchspan.span(model)``; every rank checks its gradients by
parameter name against one device on the whole batch (float64), for each loss kind users write, two
accumulated backwards, a sharded replica, and several optimizer steps. What cannot be exact is refused
before any gradient reaches ``.grad``; a pipeline across ranks refuses at ``spanned(x)`` in training.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from ranks_spawn import join_job, spawn
from torch import nn

import torchspan
from torchspan.runtime.ranks import free_port, shard_batch
from torchspan.runtime.ranks.plainloop import PlainLoopError

TOL = dict(rtol=1e-9, atol=1e-11)
HF_TOL = dict(rtol=1e-5, atol=1e-8)  # transformers computes its own loss in float32 (logits.float())


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4)).double()


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.full_tensor() if t is not None and hasattr(t, "full_tensor") else t


def _grads_match(spanned: torchspan.Spanned, reference: nn.Module, label: str, tol=TOL) -> None:
    ref = dict(reference.named_parameters())
    for name, p in spanned.module.named_parameters():
        assert p.grad is not None, f"{label}: {name} has no gradient"
        torch.testing.assert_close(
            _full(p.grad), ref[name].grad, **tol, msg=lambda m: f"{label}: {name}: {m}"
        )


def _case(
    rank: int, world: int, x, y, loss, label: str, *, shard: bool = False, backwards: int = 1, rows=None
):
    """``backwards`` plain-loop backwards of ``loss(model_out, y)`` on this rank's rows, checked against one
    device."""
    model = _model()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, shard=shard)
    assert spanned.mode == ("sharded" if shard else "data-parallel"), label
    mine_x, mine_y = shard_batch((x, y), rank, world) if rows is None else rows
    for _ in range(backwards):
        got = loss(spanned(mine_x), mine_y, spanned)
        got.backward()
    for _ in range(backwards):
        want = loss(reference(x), y, reference)
        want.backward()
    torch.testing.assert_close(
        got.detach(), want.detach(), rtol=1e-9, atol=1e-11, msg=lambda m: f"{label}: loss: {m}"
    )
    _grads_match(spanned, reference, label)
    return spanned, reference


def _losses(weights: torch.Tensor):
    ce = nn.CrossEntropyLoss()
    return {
        "cross-entropy mean": lambda out, y, m: ce(out, y),
        "class-weighted cross-entropy": lambda out, y, m: nn.CrossEntropyLoss(weight=weights)(out, y),
        "cross-entropy sum": lambda out, y, m: nn.CrossEntropyLoss(reduction="sum")(out, y),
        "padded token mean (ignore_index)": lambda out, y, m: F.cross_entropy(
            out, y.masked_fill(y == 3, -100)
        ),
        "partial of F.cross_entropy, weighted + ignored": lambda out, y, m: functools.partial(
            F.cross_entropy, weight=weights, ignore_index=1
        )(out, y),
        "log_softmax(-1) then nll_loss": lambda out, y, m: F.nll_loss(out.log_softmax(-1), y),
        "mse on a slice, view and float": lambda out, y, m: F.mse_loss(
            out[:, :2].reshape(-1).float(), y.double().repeat_interleave(2) / 3
        ),
        "two losses and an L2 penalty on the weights": lambda out, y, m: (
            ce(out, y) * 0.5
            + F.l1_loss(out, F.one_hot(y, 4).double(), reduction="sum") * 0.1
            + 1e-2 * sum(p.pow(2).sum() for p in m.parameters())
        ),
    }


def _worker(rank: int, world: int, port: int) -> None:
    join_job(rank, world, port)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(11, 5, generator=g, dtype=torch.float64)  # 6 + 5 rows
    y = torch.tensor([0, 3, 3, 1, 2, 3, 0, 1, 1, 2, 3])
    weights = torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=torch.float64)
    for label, loss in _losses(weights).items():
        _case(rank, world, x, y, loss, label)
    ce = _losses(weights)["cross-entropy mean"]
    _case(rank, world, x, y, ce, "two backwards accumulated", backwards=2)
    empty = (x, y) if rank == 0 else (x[:0], y[:0])
    _case(rank, world, x, y, ce, "empty shard on rank 1", rows=empty)
    _case(rank, world, x, y, _losses(weights)["class-weighted cross-entropy"], "sharded replica", shard=True)
    _case(rank, world, x, y, ce, "sharded replica, two backwards", shard=True, backwards=2)
    _refusals(rank, world, x, y)
    _training(rank, world, x, y, weights)
    _precisions(rank, world, x, y)


def _precisions(rank: int, world: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """bf16: each rank's rows autocast as one device would run those rows; fp16 needs train_step's scaler;
    an inf/NaN loss raises before its backward, as train_step's does."""
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4))
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, precision="bf16")
    xs, ys = x.float(), y
    F.cross_entropy(spanned(shard_batch(xs, rank, world)), shard_batch(ys, rank, world)).backward()
    for r in range(
        world
    ):  # the same rows through the same autocast, each weighed by its share of the 11 labels
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = reference(shard_batch(xs, r, world))
        (F.cross_entropy(out, shard_batch(ys, r, world), reduction="sum") / len(ys)).backward()
    for (name, p), q in zip(spanned.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(
            p.grad, q.grad, rtol=1e-6, atol=1e-9, msg=lambda m: f"bf16 plain loop: {name}: {m}"
        )
    with pytest.raises(ValueError, match="spanned.train_step"):
        torchspan.span(_model(), precision="fp16")(shard_batch(x, rank, world))
    with pytest.raises(FloatingPointError, match="the loss is nan"):
        F.mse_loss(
            torchspan.span(_model())(shard_batch(x, rank, world)),
            torch.full((len(shard_batch(x, rank, world)), 4), float("nan"), dtype=torch.float64),
        )


def _refusals(rank: int, world: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """Losses torchspan cannot weigh are refused at backward, before anything reaches .grad."""
    mine_x, mine_y = shard_batch((x, y), rank, world)
    opaque = {
        "a lambda on the outputs": lambda out: ((out - 1) ** 2).mean(),
        "reduction='none' then a mask": lambda out: (
            F.cross_entropy(out, mine_y, reduction="none") * 2
        ).sum(),
        "a mean over rows first": lambda out: F.cross_entropy(out - out.mean(0), mine_y),
        "the outputs' own sum": lambda out: out.sum(),
        "a torch loss plus a term through torch.cat": lambda out: (
            F.cross_entropy(out, mine_y) + torch.cat([out, out]).pow(2).mean()
        ),
    }
    for label, loss in opaque.items():
        spanned = torchspan.span(_model())
        with pytest.raises(PlainLoopError, match="train_step") as err:
            loss(spanned(mine_x)).backward()
        assert "loss_normalizer" in str(err.value), label
        assert all(p.grad is None for p in spanned.module.parameters()), f"{label}: a gradient reached .grad"
    for reduction, loss in (
        ("sum", lambda out: ((out - 1) ** 2).sum()),
        ("mean", lambda out: ((out - 1) ** 2).sum(1).mean()),
    ):
        spanned, reference = torchspan.span(_model(), loss_reduction=reduction), _model()
        loss(spanned(mine_x)).backward()
        loss(reference(x)).backward()
        _grads_match(spanned, reference, f"an opaque loss declared loss_reduction={reduction!r}")
    with torch.no_grad():  # evaluation: no collective, no watching
        out = torchspan.span(_model())(mine_x)
    assert type(out) is torch.Tensor
    pipeline = torchspan.span(_model(), balance=[2, 1])
    with pytest.raises(RuntimeError, match="spanned.train_step"):
        pipeline(mine_x)
    with torch.no_grad():
        pipeline(x)  # evaluation on every rank keeps working
    pipeline.eval()
    pipeline(x)


def _training(rank: int, world: int, x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> None:
    """Three plain-loop steps with clipping: the same weights as one device's loop."""
    model = _model(1)
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model)
    opt = torch.optim.Adam(spanned.parameters(), lr=0.05)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss(weight=weights)
    for step in range(3):
        rows = slice(0, 11 - 3 * step)  # uneven and shrinking: the last batch is short
        opt.zero_grad()
        crit(spanned(shard_batch(x[rows], rank, world)), shard_batch(y[rows], rank, world)).backward()
        norm = spanned.clip_grad_norm_(0.5)
        opt.step()
        ref_opt.zero_grad()
        crit(reference(x[rows]), y[rows]).backward()
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        torch.testing.assert_close(norm, want, **TOL)
    ref = dict(reference.named_parameters())
    for name, p in spanned.module.named_parameters():
        torch.testing.assert_close(
            p.detach(), ref[name].detach(), rtol=1e-8, atol=1e-10, msg=lambda m: f"{name}: {m}"
        )


def _spawn(fn, world: int, *args, deadline: float = 180.0) -> None:
    spawn(fn, world, *args, deadline=deadline)


@pytest.mark.slow
def test_plain_loop_is_one_devices_on_replicas() -> None:
    _spawn(_worker, 2, free_port())


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).double()


def _hf_worker(rank: int, world: int, port: int) -> None:
    join_job(rank, world, port)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 40, (5, 7), generator=g)
    mask = torch.ones(5, 7, dtype=torch.long)
    mask[0, -3:] = 0
    mask[3, -5:] = 0  # padding: rank 0's 3 rows hold more tokens than rank 1's 2
    labels = ids.masked_fill(mask == 0, -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    for shard in (False, True):
        model = _llama()
        reference = copy.deepcopy(model)
        spanned = torchspan.span(model, shard=shard)
        got = spanned(**shard_batch(batch, rank, world)).loss
        got.backward()
        want = reference(**batch).loss
        want.backward()
        torch.testing.assert_close(got.detach(), want.detach(), **HF_TOL)
        _grads_match(spanned, reference, f"the model's own loss, shard={shard}", HF_TOL)
    # the logits with the user's own shifted token mean: a torch loss on a slice of the outputs
    model = _llama()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model)

    def token_mean(out, y):
        return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), y[:, 1:].flatten())

    mine = shard_batch(batch, rank, world)
    token_mean(spanned(mine["input_ids"], attention_mask=mine["attention_mask"]), mine["labels"]).backward()
    token_mean(reference(ids, attention_mask=mask), labels).backward()
    _grads_match(spanned, reference, "logits with a shifted token mean")


@pytest.mark.slow
def test_plain_loop_with_a_transformers_models_own_loss() -> None:
    _spawn(_hf_worker, 2, free_port())
