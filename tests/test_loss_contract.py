"""The loss contract: every loss_fn gives the single-device gradient exactly, or is refused before any
backward.

The four cases of issue 10 run through ``span(..., balance=[2, 1], microbatches=3)`` on 7 samples
(chunks of 3, 2, 2) and compare every parameter's ``.grad`` with a plain full-batch backward;
``LossSpec``, the normalizers and the calibration are also tested directly, without a Spanned.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchspan
from torchspan.runtime.losscheck import LossChecks, batch_structure, calibrate
from torchspan.runtime.lossweights import (
    describe_loss,
    loss_spec,
    microbatch_weights,
    resolve_reduction,
    weighted_loss,
)

C = 5
GEN = torch.Generator().manual_seed(10)
X = torch.randn(7, 4, generator=GEN)
X_SEQ = torch.randn(7, 6, 4, generator=GEN)  # (B, T, features): a token model
# (B, T) labels with -100 padding, uneven over the chunks (3, 2, 2 samples)
Y_SEQ = torch.randint(0, C, (7, 6), generator=GEN)
Y_SEQ[0, 2:] = -100
Y_SEQ[3, 1:] = -100
Y_SEQ[6, 4:] = -100
Y_ALL_PAD = Y_SEQ.clone()
Y_ALL_PAD[3:5] = -100  # the second micro-batch (samples 3, 4) is all padding
SIZES = [3, 2, 2]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, C))


def _reference(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[..., Any]
) -> list[torch.Tensor]:
    ref = copy.deepcopy(model)
    loss_fn(ref(x), y).backward()
    return [p.grad.clone() for p in ref.parameters()]


def _spanned_grads(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[..., Any], **kw: Any
) -> list[torch.Tensor]:
    spanned = torchspan.span(model, devices=["cpu", "cpu"], balance=[2, 1], microbatches=3)
    spanned.train_step(x, y, loss_fn, **kw)
    return [p.grad for p in model.parameters()]


def _assert_exact(loss_fn: Callable[..., Any], x: torch.Tensor, y: torch.Tensor, **kw: Any) -> None:
    model = _model()
    ref = _reference(model, x, y, loss_fn)
    got = _spanned_grads(model, x, y, loss_fn, **kw)
    for g, r in zip(got, ref):
        assert g is not None and torch.isfinite(g).all()
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def _token_ce(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(o.reshape(-1, C), t.reshape(-1))


def _token_mean(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    per_token = F.cross_entropy(o.reshape(-1, C), t.clamp(min=0).reshape(-1), reduction="none").reshape(
        t.shape
    )
    mask = (t != -100).float()
    return (per_token * mask).sum() / mask.sum()


# ------------------------------------------------------------------ the four cases of the issue


def test_summing_lambda_is_calibrated_to_a_sum() -> None:
    y = torch.randn(7, C, generator=GEN)
    _assert_exact(lambda o, t: (o * t).sum(), X, y)


def test_partial_of_cross_entropy_uses_its_weight_and_ignore_index() -> None:
    w = torch.tensor([0.2, 1.0, 3.0, 0.5, 2.0])
    y = torch.tensor([0, 4, -100, 2, 2, 1, -100])
    _assert_exact(functools.partial(F.cross_entropy, weight=w, ignore_index=-100), X, y)


def test_reshaping_cross_entropy_lambda_with_padding_is_refused_before_backward() -> None:
    model = _model()
    with pytest.raises(ValueError) as err:
        _spanned_grads(model, X_SEQ, Y_SEQ, lambda o, t: F.cross_entropy(o.reshape(-1, C), t.reshape(-1)))
    msg = str(err.value)
    assert "loss_fn=<lambda> at test_loss_contract.py:" in msg
    full = _token_ce(model(X_SEQ), Y_SEQ).item()
    assert f"{full:.5g}"[:6] in msg  # the full-batch value is named
    for way_out in (
        "loss_reduction='sum'",
        "loss_reduction='mean'",
        "loss_normalizer=lambda y: (y != -100).sum()",
    ):
        assert way_out in msg
    assert all(p.grad is None for p in model.parameters())  # refused before any backward


def test_reshaping_cross_entropy_lambda_is_exact_with_a_normalizer() -> None:
    _assert_exact(
        lambda o, t: F.cross_entropy(o.reshape(-1, C), t.reshape(-1)),
        X_SEQ,
        Y_SEQ,
        loss_normalizer=lambda y: (y != -100).sum(),
    )


def test_token_mean_with_an_all_padding_microbatch_is_exact_and_finite_with_a_normalizer() -> None:
    _assert_exact(_token_mean, X_SEQ, Y_ALL_PAD, loss_normalizer=lambda y: (y != -100).sum())


def test_token_mean_with_an_all_padding_microbatch_is_refused_without_one() -> None:
    model = _model()
    with pytest.raises(
        ValueError,
        match=r"loss_fn=_token_mean is not a per-sample mean or a sum: .* nan weighted by sample share",
    ):
        _spanned_grads(model, X_SEQ, Y_ALL_PAD, _token_mean)
    assert all(p.grad is None for p in model.parameters())


# ------------------------------------------------------------------ calibration inside train_step


def test_opaque_mean_is_calibrated_once_per_batch_structure() -> None:
    model = _model()
    spanned = torchspan.span(model, devices=["cpu", "cpu"], balance=[2, 1], microbatches=3)
    y = torch.randn(7, C, generator=GEN)
    for _ in range(3):  # a new lambda object each step, same code: one calibration
        spanned.train_step(X, y, lambda o, t: F.mse_loss(o, t))
    assert spanned._loss_checks.calibrations == 1
    spanned.train_step(X[:6], y[:6], lambda o, t: F.mse_loss(o, t))  # another split: checked again
    assert spanned._loss_checks.calibrations == 2
    spanned.train_step(X, y, F.mse_loss)  # known: never calibrated
    assert spanned._loss_checks.calibrations == 2


def test_calibration_leaves_no_trace_in_random_state_or_buffers() -> None:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.BatchNorm1d(8), nn.Linear(8, C))

    y = torch.randn(7, C, generator=GEN)
    runs = []
    for kw in ({}, {"loss_reduction": "mean"}):  # calibrated vs declared (no dry forward)
        model = build()
        spanned = torchspan.span(model, devices=["cpu", "cpu"], balance=[3, 1], microbatches=3)
        torch.manual_seed(1)
        with pytest.warns(UserWarning, match="BatchNorm"):
            spanned.train_step(X, y, lambda o, t: F.mse_loss(o, t), **kw)
        runs.append(
            ([p.grad.clone() for p in model.parameters()], model[2].running_mean.clone(), torch.rand(3))
        )
    (g0, bn0, r0), (g1, bn1, r1) = runs
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(bn0, bn1, rtol=0, atol=0)
    torch.testing.assert_close(r0, r1, rtol=0, atol=0)


# ------------------------------------------------------------------ LossSpec and normalizers


@pytest.mark.parametrize(
    ("loss_fn", "kind"),
    [
        (nn.MSELoss(), "samples"),
        (nn.MSELoss(reduction="sum"), "sum"),
        (nn.KLDivLoss(reduction="batchmean"), "samples"),
        (nn.CrossEntropyLoss(label_smoothing=0.1), "class_weights"),
        (F.nll_loss, "class_weights"),
        (F.binary_cross_entropy_with_logits, "samples"),
        (functools.partial(F.mse_loss, reduction="sum"), "sum"),
        (functools.partial(F.l1_loss, size_average=False), "sum"),
        (
            functools.partial(functools.partial(F.cross_entropy, weight=torch.ones(3)), ignore_index=2),
            "class_weights",
        ),
        (functools.partial(nn.CrossEntropyLoss()), "class_weights"),
        (functools.partial(F.mse_loss, torch.zeros(3)), "opaque"),  # input bound positionally
        (lambda o, t: F.mse_loss(o, t), "opaque"),
        (nn.Linear(2, 2), "opaque"),
    ],
)
def test_loss_spec_reads_known_losses(loss_fn: Callable[..., Any], kind: str) -> None:
    assert loss_spec(loss_fn).kind == kind


def test_a_loss_subclass_with_its_own_forward_is_opaque() -> None:
    class Halved(nn.CrossEntropyLoss):
        def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return super().forward(input, target) / 2

    class Plain(nn.CrossEntropyLoss):
        pass

    assert loss_spec(Halved()).kind == "opaque"
    assert loss_spec(Plain(ignore_index=3)).ignore_index == 3


def test_partial_keywords_are_read() -> None:
    w = torch.tensor([1.0, 2.0, 3.0])
    spec = loss_spec(functools.partial(F.cross_entropy, weight=w, ignore_index=1, label_smoothing=0.2))
    assert spec.kind == "class_weights" and spec.class_weight is w and spec.ignore_index == 1
    assert spec.normalizer(torch.tensor([0, 1, 2, 2]), 4) == 1.0 + 3.0 + 3.0


def test_contradictions_and_bad_arguments_are_refused() -> None:
    with pytest.raises(
        ValueError, match=r"loss_reduction='mean' contradicts loss_fn=partial\(mse_loss, reduction='sum'\)"
    ):
        loss_spec(functools.partial(F.mse_loss, reduction="sum"), loss_reduction="mean")
    with pytest.raises(
        ValueError, match=r"loss_fn=partial\(nll_loss, reduction='none'\) returns one loss per element"
    ):
        loss_spec(functools.partial(F.nll_loss, reduction="none"))
    with pytest.raises(
        ValueError, match="loss_normalizer= given for loss_fn=MSELoss\\(reduction='sum'\\), which sums"
    ):
        loss_spec(nn.MSELoss(reduction="sum"), loss_normalizer=lambda y: 1)
    with pytest.raises(ValueError, match="loss_reduction='sum' with loss_normalizer="):
        loss_spec(lambda o, t: o.sum(), loss_reduction="sum", loss_normalizer=lambda y: 1)
    with pytest.raises(TypeError, match="loss_normalizer=3 is not callable"):
        loss_spec(F.mse_loss, loss_normalizer=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"loss_fn=<lambda> .* is opaque"):
        loss_spec(lambda o, t: o.sum()).weights([None], [1])


LOGITS = torch.randn(7, C, 3, generator=GEN)  # (N, C, d1) inputs
LABELS = torch.randint(0, C, (7, 3), generator=GEN)
LABELS[3:5] = -100  # one chunk all ignored
LABELS[0, 0] = -100


@pytest.mark.parametrize(
    "loss_fn",
    [
        nn.CrossEntropyLoss(weight=torch.tensor([0.2, 1.0, 3.0, 0.5, 2.0])),
        functools.partial(
            F.cross_entropy, weight=torch.tensor([0.2, 1.0, 3.0, 0.5, 2.0]), label_smoothing=0.1
        ),
        functools.partial(F.nll_loss, weight=torch.tensor([0.2, 1.0, 3.0, 0.5, 2.0])),
        nn.CrossEntropyLoss(reduction="sum"),
    ],
)
def test_weighted_chunks_add_up_to_the_full_loss_for_spatial_targets(loss_fn: Callable[..., Any]) -> None:
    spec = loss_spec(loss_fn)
    outs, tgts = list(LOGITS.split(SIZES)), list(LABELS.split(SIZES))
    weights = spec.weights(tgts, SIZES)
    assert weights[1] == (0.0 if spec.kind == "class_weights" else 1.0)
    total = sum(weighted_loss(loss_fn, o, t, w) for o, t, w in zip(outs, tgts, weights))
    assert torch.isfinite(total)
    torch.testing.assert_close(total, loss_fn(LOGITS, LABELS))


def test_weights_with_a_global_total_split_over_ranks() -> None:
    """Data parallel: each rank weighs its chunks by the all-reduced normalizer; the sum over ranks is
    exact."""
    spec = loss_spec(nn.CrossEntropyLoss(weight=torch.tensor([0.2, 1.0, 3.0, 0.5, 2.0])))
    outs, tgts = list(LOGITS.split(SIZES)), list(LABELS.split(SIZES))
    total = sum(spec.normalizer(t, n) for t, n in zip(tgts, SIZES))
    rank0 = spec.weights(tgts[:1], SIZES[:1], total=total)
    rank1 = spec.weights(tgts[1:], SIZES[1:], total=total)
    got = sum(weighted_loss(spec.loss_fn, o, t, w) for o, t, w in zip(outs, tgts, rank0 + rank1))
    torch.testing.assert_close(got, spec.loss_fn(LOGITS, LABELS))
    with pytest.raises(ValueError, match="total=nan is not a finite normalizer"):
        spec.weights(tgts, SIZES, total=float("nan"))


def test_user_normalizer_values_are_checked() -> None:
    spec = loss_spec(_token_mean, loss_normalizer=lambda y: (y != -100).sum())
    assert spec.kind == "user" and spec.normalizer(Y_SEQ[:3], 3) == float((Y_SEQ[:3] != -100).sum())
    for bad, shown in (
        (lambda y: y, "a tensor of shape (3, 6)"),
        (lambda y: -1.0, "-1.0"),
        (lambda y: "n", "'n'"),
    ):
        with pytest.raises(
            ValueError, match="loss_normalizer returned " + shown.replace("(", r"\(").replace(")", r"\)")
        ):
            loss_spec(_token_mean, loss_normalizer=bad).normalizer(Y_SEQ[:3], 3)


def test_earlier_helpers_keep_working() -> None:
    assert resolve_reduction(lambda o, t: o.sum(), None) == "mean"
    assert resolve_reduction(nn.L1Loss(reduction="sum"), None) == "sum"
    assert microbatch_weights(
        F.cross_entropy, [torch.tensor([1, -100]), torch.tensor([2, 3])], [2, 2], "mean"
    ) == [1 / 3, 2 / 3]
    assert microbatch_weights(lambda o, t: o.sum(), [None, None], [3, 1], "sum") == [1.0, 1.0]


def test_describe_loss() -> None:
    assert (
        describe_loss(functools.partial(F.cross_entropy, weight=torch.ones(3)))
        == "partial(cross_entropy, weight=<tensor (3,)>)"
    )
    assert describe_loss(nn.NLLLoss()) == "NLLLoss(reduction='mean')"
    assert describe_loss(_token_mean) == "_token_mean"


# ------------------------------------------------------------------ calibration as a pure function


def _chunks(
    out: torch.Tensor, y: torch.Tensor, sizes: list[int] = SIZES
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return list(out.split(sizes)), list(y.split(sizes))


def test_calibrate_decides_sum_or_mean() -> None:
    out, y = torch.randn(7, C, generator=GEN), torch.randn(7, C, generator=GEN)
    assert calibrate(loss_spec(lambda o, t: (o * t).sum()), *_chunks(out, y), SIZES).kind == "sum"
    assert calibrate(loss_spec(lambda o, t: ((o - t) ** 2).mean()), *_chunks(out, y), SIZES).kind == "samples"
    known = loss_spec(F.mse_loss)
    assert calibrate(known, *_chunks(out, y), SIZES) is known  # nothing to check


def test_calibrate_refuses_a_token_mean_naming_the_values() -> None:
    out = torch.randn(7, 6, C, generator=GEN)
    spec = loss_spec(_token_ce)
    full = _token_ce(out, Y_SEQ).item()
    with pytest.raises(ValueError) as err:
        calibrate(spec, *_chunks(out, Y_SEQ), SIZES)
    msg = str(err.value)
    assert msg.startswith(
        f"loss_fn=_token_ce is not a per-sample mean or a sum: the full-batch loss is {full:.8g}, but its "
        "3 micro-batches of 3, 2, 2 samples give "
    )
    assert "refuses before any backward" in msg
    user = loss_spec(_token_ce, loss_normalizer=lambda y: (y != -100).sum())
    assert calibrate(user, *_chunks(out, Y_SEQ), SIZES) is user
    wrong = loss_spec(_token_ce, loss_normalizer=lambda y: y.numel())
    with pytest.raises(ValueError, match="loss_normalizer does not make loss_fn=_token_ce exact"):
        calibrate(wrong, *_chunks(out, Y_SEQ), SIZES)


def test_calibrate_refuses_when_the_batch_cannot_tell() -> None:
    out, y = torch.randn(7, C, generator=GEN), torch.zeros(7, C)
    with pytest.raises(
        ValueError, match=r"cannot tell from this batch whether loss_fn=<lambda> .* is a mean or a sum"
    ):
        calibrate(loss_spec(lambda o, t: (o * t).sum()), *_chunks(out, y), SIZES)


def test_calibrate_one_microbatch_needs_no_evaluation() -> None:
    def never(o: Any, t: Any) -> torch.Tensor:
        raise AssertionError("not evaluated")

    assert calibrate(loss_spec(never), [torch.ones(2)], [torch.ones(2)], [2]).kind == "samples"


def test_identical_microbatches_of_a_mean_are_a_mean() -> None:
    out, y = torch.randn(2, C, generator=GEN).repeat(3, 1), torch.randn(2, C, generator=GEN).repeat(3, 1)
    spec = calibrate(loss_spec(lambda o, t: F.l1_loss(o, t)), *_chunks(out, y, [2, 2, 2]), [2, 2, 2])
    assert spec.kind == "samples" and spec.weights([None] * 3, [2, 2, 2]) == pytest.approx([1 / 3] * 3)


def test_loss_checks_remember_per_loss_and_structure() -> None:
    out = torch.randn(7, 6, C, generator=GEN)
    y = Y_SEQ.clamp(min=0)
    checks = LossChecks()
    outs, tgts = _chunks(out, y)
    scale = 2.0
    for _ in range(2):
        assert (
            checks.resolve(loss_spec(lambda o, t: _token_ce(o, t) * scale), tgts, SIZES, lambda: outs).kind
            == "samples"
        )
    assert checks.calibrations == 1
    scale = 3.0  # the lambda now captures another object: checked again
    checks.resolve(loss_spec(lambda o, t: _token_ce(o, t) * scale), tgts, SIZES, lambda: outs)
    assert checks.calibrations == 2
    # padding appears in the same shapes: the structure differs, and the refusal comes then
    with pytest.raises(ValueError, match="is not a per-sample mean or a sum"):
        checks.resolve(
            loss_spec(lambda o, t: _token_ce(o, t) * scale), list(Y_SEQ.split(SIZES)), SIZES, lambda: outs
        )
    assert batch_structure(tgts, SIZES) != batch_structure(list(Y_SEQ.split(SIZES)), SIZES)
