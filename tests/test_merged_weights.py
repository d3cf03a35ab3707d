"""Merged weights: every stage's weight backwards last, each linear layer's weight gradient one product.

The schedule as data (1F1B's order with input backwards, then every weight backward); the split itself
(``splitgrad.input_backward(..., merge=True)`` over uneven micro-batches, then one ``weights_together``)
against one whole ``backward`` per micro-batch; ``span(..., schedule="merged-weights")`` in one process
and across gloo ranks against one device on the whole batch (float64: only the order of additions
differs). That merging really happens is seen from the parameters' own hooks: a merged weight's
``post_accumulate_grad`` hook fires once per step, not once per micro-batch.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import torch
from runtime_models import residual, residual_loss, sequential
from test_ranks_pipeline import LOSS_TOL, _check, _join, _leave, _seq, _spawn
from test_zero_bubble import Twice, _float64, hybrid_runs, tied_across_ranks  # noqa: F401 (_float64: autouse, float64)
from torch import nn

import torchspan
from torchspan import schedule as sched
from torchspan.runtime.ranks import free_port
from torchspan.runtime.splitgrad import input_backward, weights_together

TOL = dict(rtol=1e-10, atol=1e-12)


def _count_accumulations(model: nn.Module, fired: dict[str, int] | None = None) -> dict[str, int]:
    """How many times autograd accumulated into each parameter's ``.grad`` (its post-accumulate hook), by name
    (a deep copy's parameters, which may carry the hooks along, are not counted)."""
    fired = {} if fired is None else fired

    def hook_for(name: str, param: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if p is param:
                fired[name] = fired.get(name, 0) + 1

        return hook

    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(hook_for(name, p))
    return fired


# ---------------------------------------------------------------------- the schedule as data
def _respects_dependencies(plan: list[list[sched.Action]]) -> None:
    clock = {(a.kind, a.stage, a.microbatch): a.clock for actions in plan for a in actions}
    n = len(plan)
    for s, actions in enumerate(plan):
        assert all(a.stage == s for a in actions)
        assert [a.clock for a in actions] == sorted({a.clock for a in actions}), (
            f"stage {s}: clocks not strictly increasing"
        )
        for a in actions:
            i = a.microbatch
            if a.kind == sched.FORWARD and s > 0:
                assert a.clock > clock[(sched.FORWARD, s - 1, i)]
            if a.kind == sched.BACKWARD_INPUT:
                assert a.clock > clock[(sched.FORWARD, s, i)]
                if s < n - 1:
                    assert a.clock > clock[(sched.BACKWARD_INPUT, s + 1, i)]
            if a.kind == sched.BACKWARD_WEIGHT:
                assert a.clock > clock[(sched.BACKWARD_INPUT, s, i)], f"stage {s}: W{i} before its B-input"


@pytest.mark.parametrize("m,n", [(4, 2), (1, 1), (1, 3), (4, 1), (5, 3), (2, 4)])
def test_schedule_runs_forwards_first_then_input_backwards_then_every_weight_backward(m: int, n: int) -> None:
    plan = sched.merged_weights(m, n)
    assert len(plan) == n
    weights = [(sched.BACKWARD_WEIGHT, i) for i in range(m)]
    for s, actions in enumerate(plan):
        if s < n - 1:  # every micro-batch is held anyway: forwards as early as they can run
            want = [(sched.FORWARD, i) for i in range(m)] + [(sched.BACKWARD_INPUT, i) for i in range(m)]
        else:  # the last stage: each forward's input backward at once (what the stage before waits for)
            want = [(kind, i) for i in range(m) for kind in (sched.FORWARD, sched.BACKWARD_INPUT)]
        assert [(a.kind, a.microbatch) for a in actions] == want + weights, f"stage {s}"
        assert sched.max_live(actions) == m  # every micro-batch held until the weight backwards at the end
        assert sched.weight_run_ends(actions) == {m - 1}  # one merged pass
    _respects_dependencies(plan)
    assert sched.build("merged-weights", m, n) == plan


def test_early_receives_come_from_stages_that_run_their_forwards_first() -> None:
    assert sched.early_receives(sched.merged_weights(4, 2), 1, [0]) == [(0, [0, 1, 2, 3])]
    assert sched.early_receives(sched.merged_weights(3, 3), 2, range(2)) == [(0, [0, 1, 2]), (1, [0, 1, 2])]
    assert sched.early_receives(sched.gpipe(3, 2), 1, [0]) == [(0, [0, 1, 2])]
    assert (
        sched.early_receives(sched.one_f_one_b(4, 2), 1, [0]) == []
    )  # 1F1B holds forwards back: nothing ahead
    assert not sched.forwards_first(sched.merged_weights(4, 2)[1])  # the last stage alternates


def test_schedule_of_four_microbatches_on_two_stages_and_its_name() -> None:
    short = {sched.FORWARD: "F", sched.BACKWARD_INPUT: "I", sched.BACKWARD_WEIGHT: "W"}
    plan = sched.merged_weights(4, 2)
    assert [
        f"{short[a.kind]}{a.microbatch}" for a in plan[0]
    ] == "F0 F1 F2 F3 I0 I1 I2 I3 W0 W1 W2 W3".split()
    assert [
        f"{short[a.kind]}{a.microbatch}" for a in plan[1]
    ] == "F0 I0 F1 I1 F2 I2 F3 I3 W0 W1 W2 W3".split()
    assert [a.clock for a in plan[1]] == list(range(1, 13))
    assert [sched.max_live(a) for a in plan] == [4, 4]
    assert "merged-weights" in sched.SCHEDULES
    assert sched.merges_weights("merged-weights")
    assert not any(sched.merges_weights(name) for name in sched.SCHEDULES if name != "merged-weights")
    with pytest.raises(ValueError):
        sched.merged_weights(0, 2)


def _idle_of_last_stage(plan: list[list[sched.Action]], hop: float) -> float:
    """An event simulation of ``plan``: each action takes one unit, a value crossing to another stage ``hop``
    more; the last stage's idle time between its first action and its last."""
    end: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * len(plan)
    todo = [list(actions) for actions in plan]
    while any(todo):
        for s, actions in enumerate(todo):
            while actions:
                a = actions[0]
                deps = {
                    sched.FORWARD: [(sched.FORWARD, s - 1, a.microbatch, hop)] if s else [],
                    sched.BACKWARD_INPUT: [(sched.FORWARD, s, a.microbatch, 0.0)]
                    + ([(sched.BACKWARD_INPUT, s + 1, a.microbatch, hop)] if s < len(plan) - 1 else []),
                    sched.BACKWARD_WEIGHT: [(sched.BACKWARD_INPUT, s, a.microbatch, 0.0)],
                }[a.kind]
                if any((k, t, i) not in end for k, t, i, _ in deps):
                    break
                start = max([clock[s]] + [end[(k, t, i)] + lag for k, t, i, lag in deps])
                end[(a.kind, s, a.microbatch)] = clock[s] = start + 1.0
                actions.pop(0)
    last = plan[-1]
    first_start = end[(last[0].kind, len(plan) - 1, last[0].microbatch)] - 1.0
    return clock[-1] - first_start - len(last)


@pytest.mark.parametrize("m,n", [(4, 2), (8, 2), (4, 3), (6, 4)])
def test_the_last_stage_never_waits_for_a_forward_when_values_take_time_to_cross(m: int, n: int) -> None:
    """With a hop between ranks, 1F1B's order holds each forward on the way down behind an input backward that
    made a round trip; running the earlier stages' forwards first keeps the last stage busy from its first
    micro-batch to its last weight backward."""
    assert _idle_of_last_stage(sched.merged_weights(m, n), hop=0.5) == 0.0
    one_f_one_b_order = [
        [
            sched.Action(
                a.clock, a.stage, a.microbatch, sched.BACKWARD_INPUT if a.kind == sched.BACKWARD else a.kind
            )
            for a in actions
        ]
        + [sched.Action(0, s, i, sched.BACKWARD_WEIGHT) for i in range(m)]
        for s, actions in enumerate(sched.one_f_one_b(m, n))
    ]
    assert _idle_of_last_stage(one_f_one_b_order, hop=0.5) > 0.0


# ---------------------------------------------------------------------- the split itself
class NormFirst(nn.Module):
    """A first stage: LayerNorm (not a linear call: its weights come from the frontier pass) before a
    Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.l = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.l(self.norm(x)))


class Shared(nn.Module):
    """A weight read by a linear call (``x @ w.t()``) and on its own (``w.sum()``): merging must fall back."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w.t()) + self.w.sum()


class Biases(nn.Module):
    """One weight in two linear calls, with a bias on the first call, the second, or each its own."""

    def __init__(self, first: bool, second: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.b1 = nn.Parameter(torch.randn(8)) if first else None
        self.b2 = nn.Parameter(torch.randn(8)) if second else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(torch.tanh(nn.functional.linear(x, self.w, self.b1)), self.w, self.b2)


class Conv1D(nn.Module):
    """GPT-2's linear layer: the weight stored ``(in, out)`` and multiplied as stored, ``addmm(b, x, w)``."""

    def __init__(self, nx: int, nf: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(nx, nf)), nn.Parameter(torch.randn(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(
            *x.shape[:-1], self.weight.size(-1)
        )


class BothWays(nn.Module):
    """A square weight multiplied as stored (``x @ w``) and through ``t()``: one gradient of both."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w) @ self.w.t()


def _rows(*shape: int) -> Callable[[int], torch.Tensor]:
    return lambda rows: torch.randn(rows, *shape)


def _transposed(rows: int) -> torch.Tensor:
    """(rows, 5, 8), not contiguous unless ``rows == 1``: nn.Linear takes matmul + add (bias apart) on it,
    addmm on one row."""
    return torch.randn(5, rows, 8).transpose(0, 1)


Case = tuple[Callable[[], nn.Module], Callable[[int], torch.Tensor], bool, str, bool]
# name: (model, one micro-batch's input of so many rows, the input needs a gradient, the watched weight,
# merged)
SPLITS: dict[str, Case] = {
    "sequential": (
        lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)),
        _rows(8),
        True,
        "2.weight",
        True,
    ),
    "twice": (Twice, _rows(8), True, "l.weight", True),
    "first stage": (NormFirst, _rows(8), False, "l.weight", True),
    "3-d": (
        lambda: nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8, bias=False)),
        _rows(5, 8),
        True,
        "2.weight",
        True,
    ),
    "shared": (Shared, _rows(8), True, "w", False),
    "conv1d": (
        lambda: nn.Sequential(Conv1D(8, 8), nn.Tanh(), Conv1D(8, 8)),
        _rows(5, 8),
        True,
        "0.weight",
        True,
    ),
    "both ways": (BothWays, _rows(8), True, "w", True),
}


def _merged_equals_whole(
    case: str, spec: Case, explicit_params: bool = False, grads_before: bool = False
) -> None:
    """3 uneven micro-batches through ``input_backward(..., merge=True)`` and one ``weights_together``
    against one whole ``backward`` per micro-batch on a deep copy."""
    make, inputs, needs_grad, watched, merges = spec
    torch.manual_seed(0)
    whole = make()
    merged = copy.deepcopy(whole)
    if grads_before:  # accumulation into existing .grad, as backward does
        for p, q in zip(whole.parameters(), merged.parameters()):
            p.grad, q.grad = torch.full_like(p, 0.5), torch.full_like(q, 0.5)
    before = {name: None if q.grad is None else q.grad.clone() for name, q in merged.named_parameters()}
    seen: dict[str, list[torch.Tensor]] = {"whole": [], "merged": []}
    for label, model in (("whole", whole), ("merged", merged)):
        dict(model.named_parameters())[watched].register_hook(
            lambda g, label=label: seen[label].append(g.clone())
        )
    fired = _count_accumulations(merged)
    rows = (3, 1, 4)  # uneven micro-batches
    pendings = []
    for x in [inputs(r) for r in rows]:
        a, b = x.clone().requires_grad_(needs_grad), x.clone().requires_grad_(needs_grad)
        out = whole(a)
        g = torch.randn_like(out)
        out.backward(g)
        params = list(merged.parameters()) if explicit_params else None
        found, pending = input_backward([merged(b)], [g], [b] if needs_grad else [], params, merge=True)
        assert pending, "nothing was left for the weight pass"
        if needs_grad:
            assert len(found) == 1
            torch.testing.assert_close(found[0], a.grad, **TOL)
            assert b.grad is None  # the inputs' gradients are returned, not accumulated
        else:
            assert found == []
        pendings.append(pending)
    # no parameter's .grad touched, no hook fired before the weight pass
    assert fired == {} and seen["merged"] == []
    for name, q in merged.named_parameters():
        assert (q.grad is None) if before[name] is None else torch.equal(q.grad, before[name]), name
    weights_together(pendings)
    for (name, p), q in zip(whole.named_parameters(), merged.parameters()):
        assert (p.grad is None) == (q.grad is None), (
            f"{case}: {name}: {'no' if q.grad is None else 'a'} gradient"
        )
        torch.testing.assert_close(q.grad, p.grad, **TOL, msg=lambda m: f"{case}: {name}: {m}")
    if merges:  # one accumulation for the three micro-batches, of their summed gradient
        assert fired[watched] == 1, fired
        assert len(seen["merged"]) == 1 and len(seen["whole"]) == len(rows)
        torch.testing.assert_close(seen["merged"][0], sum(seen["whole"]), **TOL)
    else:  # fell back to a split per micro-batch: one accumulation each
        assert fired[watched] == len(rows), fired
    weights_together(pendings)  # a second call finds nothing left to add
    for p, q in zip(whole.parameters(), merged.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **TOL)


@pytest.mark.parametrize("grads_before", [False, True], ids=["fresh", "accumulating"])
@pytest.mark.parametrize("explicit_params", [False, True], ids=["params=None", "param-list"])
@pytest.mark.parametrize("case", list(SPLITS))
def test_merged_split_over_uneven_microbatches_equals_backward_each(
    case: str, explicit_params: bool, grads_before: bool
) -> None:
    _merged_equals_whole(case, SPLITS[case], explicit_params, grads_before)


@pytest.mark.parametrize(
    "case",
    [
        "bias on the first call",
        # each record's own bias (a weight's first record's bias took them all before)
        "bias on the second call",
        "a bias per call",  # each record's own bias (a weight's first record's bias took them all before)
        # each record's own bias (a weight's first record's bias took them all before)
        "3-d, contiguous in one micro-batch",
    ],
)
def test_merged_split_of_one_weight_with_and_without_biases(case: str) -> None:
    specs: dict[str, Case] = {
        "bias on the first call": (lambda: Biases(True, False), _rows(8), True, "w", True),
        "bias on the second call": (lambda: Biases(False, True), _rows(8), True, "w", True),
        "a bias per call": (lambda: Biases(True, True), _rows(8), True, "w", True),
        # micro-batches of 3, 1, 4 rows: matmul + add, addmm (the bias merged), matmul + add
        "3-d, contiguous in one micro-batch": (
            lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
            _transposed,
            True,
            "0.weight",
            True,
        ),
    }
    _merged_equals_whole(case, specs[case])


def test_merged_products_become_the_grad_without_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """From ``.grad = None`` each merged product is kept as ``.grad`` itself, as autograd keeps a gradient it
    made (a gradient handed to the engine from Python was copied first: a weight's size per parameter and
    step); onto an existing ``.grad`` it is added in place. Hooks on the parameters still fire once."""
    from torchspan.runtime import linearw

    made: list[int] = []
    real = linearw.gradients

    def watched(records: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        leaves, grads = real(records)
        made.extend(g.data_ptr() for g in grads)
        return leaves, grads

    monkeypatch.setattr(linearw, "gradients", watched)
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    fired = _count_accumulations(model)
    for step in range(2):  # fresh, then accumulating
        kept = {name: p.grad for name, p in model.named_parameters()}
        made.clear()
        pendings = []
        for rows in (3, 5):
            x = torch.randn(rows, 32, requires_grad=True)
            out = model(x)
            pendings.append(input_backward([out], [torch.randn_like(out)], [x], merge=True)[1])
        weights_together(pendings)
        params = dict(model.named_parameters())
        if step == 0:
            assert sorted(p.grad.data_ptr() for p in params.values()) == sorted(made), (
                "a merged gradient was copied into .grad"
            )
        else:
            assert all(params[name].grad is g for name, g in kept.items()), (
                "an existing .grad was replaced, not added to"
            )
    assert fired == {name: 2 for name in params}


def test_merged_split_frees_the_graph_when_nothing_else_is_left() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    out = model(x)
    g = torch.randn_like(out)
    _, pending = input_backward([out], [g], [x], merge=True)
    with pytest.raises(
        RuntimeError, match="second time"
    ):  # only the linear calls' inputs and output gradients kept
        out.backward(g)
    pending.weights()
    assert all(p.grad is not None for p in model.parameters())


# ---------------------------------------------------------------------- one process
def _data(rows: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(rows, 6, generator=torch.Generator().manual_seed(3))
    return x, torch.randn(rows, 3, generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("recompute", ["never", "except_last", "always"])
@pytest.mark.parametrize("devices,balance", [(["cpu", "cpu"], [3, 4]), (["cpu", "cpu", "cpu"], [2, 2, 3])])
def test_one_process_merged_weights_matches_one_device(
    recompute: str, devices: list[str], balance: list[int]
) -> None:
    x, y = _data()
    reference, model = sequential(), sequential()
    fired = _count_accumulations(model)
    spanned = torchspan.span(
        model,
        devices=devices,
        balance=balance,
        microbatches=4,
        schedule="merged-weights",
        recompute=recompute,
    )
    for step, rows in enumerate(
        (10, 7), start=1
    ):  # 3, 3, 2, 2 rows; then 2, 2, 2, 1, accumulating into .grad
        loss = spanned.train_step(x[:rows], y[:rows], nn.functional.mse_loss)
        want = nn.functional.mse_loss(reference(x[:rows]), y[:rows])
        want.backward()
        torch.testing.assert_close(loss.double(), want.detach(), **LOSS_TOL)
        for (name, p), r in zip(spanned.module.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, r.grad, **TOL, msg=lambda m: f"step {step}: {name}: {m}")
        assert fired == {
            name: step for name, _ in model.named_parameters()
        }  # once per step: all 4 micro-batches merged
        kinds = [(e.kind, e.stage) for e in spanned.timeline()]
        for s in range(len(devices)):  # one weight pass per stage, after its 4 input backwards
            assert kinds.count(("backward_weight", s)) == 1 and kinds.count(("backward", s)) == 4


def test_one_process_merged_weights_fx_residual_and_accumulation() -> None:
    model = residual()
    ref = copy.deepcopy(model)
    fired = _count_accumulations(model)
    x, extra, y, mask = torch.randn(7, 6), torch.randn(7, 16), torch.randn(7, 3), torch.rand(16)
    spanned = torchspan.span(
        model, devices="cpu,cpu,cpu", balance=[1, 2, 1], microbatches=3, schedule="merged-weights"
    )
    assert spanned.mode == "fx"
    for rows in (7, 5):  # a second step accumulates into .grad, as on one device
        inputs = {"x": x[:rows], "extra": extra[:rows], "mask": torchspan.runtime.NoSplit(mask), "gain": 2.0}
        spanned.train_step(inputs, y[:rows], residual_loss)
        residual_loss(ref(x[:rows], extra[:rows], mask=mask, gain=2.0), y[:rows]).backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, **TOL, msg=lambda m: f"{name}: {m}")
    for name in (
        "embed.weight",
        "block1.weight",
        "block2.weight",
        "head.weight",
    ):  # linear layers on every stage merged
        assert fired[name] == 2, fired
    assert "backward_weight" in {e.kind for e in spanned.timeline()}


FP16_SCALE = 2.0**16  # the scaler's first scale


def _autocast_run(
    schedule: str | None, x: torch.Tensor, y: torch.Tensor, precision: str, **options
) -> tuple[list[torch.Tensor], dict[str, int]]:
    """A float32 model's gradients under autocast (one device on the whole batch when ``schedule`` is
    ``None``; under fp16 its loss scaled by ``FP16_SCALE`` and the gradients divided back, as the span's
    scaler does), and how many times each parameter's ``.grad`` was accumulated into."""
    model = sequential().float()
    fired = _count_accumulations(model)
    if schedule is None:
        with torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16" else torch.float16):
            loss = nn.functional.mse_loss(model(x), y)
        (loss * (FP16_SCALE if precision == "fp16" else 1.0)).backward()
        for p in model.parameters() if precision == "fp16" else ():
            p.grad /= FP16_SCALE  # a power of two: exact
    else:
        spanned = torchspan.span(
            model, devices=["cpu", "cpu"], microbatches=3, schedule=schedule, precision=precision, **options
        )
        if precision == "fp16":
            assert spanned.scaler is not None and spanned.scaler.get_scale() == FP16_SCALE
        spanned.train_step(x, y, nn.functional.mse_loss)
    return [p.grad for p in model.parameters()], fired


def _catches_wrong_grads(grads: list[torch.Tensor], check: Callable[[list[torch.Tensor]], None]) -> None:
    """``check(grads)`` passes, and fails (``AssertionError``) with any one gradient zeroed or scaled by
    0.8."""
    check(grads)
    for i, g in enumerate(grads):
        for wrong in (torch.zeros_like(g), g * 0.8):
            with pytest.raises(AssertionError):
                check([*grads[:i], wrong, *grads[i + 1 :]])


def test_one_process_merged_weights_under_bf16_is_closer_to_one_device_than_1f1b() -> None:
    g = torch.Generator().manual_seed(5)
    x, y = (
        torch.randn(9, 6, generator=g, dtype=torch.float32),
        torch.randn(9, 3, generator=g, dtype=torch.float32),
    )
    one, _ = _autocast_run(None, x, y, "bf16")
    merged, fired = _autocast_run("merged-weights", x, y, "bf16", balance=[3, 4])
    base, _ = _autocast_run("1f1b", x, y, "bf16", balance=[3, 4])
    assert set(fired.values()) == {1}, fired  # merged through autocast's bf16 copies of the weights
    assert all(m.dtype == torch.float32 for m in merged)

    def equal_to_one_device(grads: list[torch.Tensor]) -> None:
        assert all(torch.equal(m, r) for m, r in zip(grads, one, strict=True))

    # bit-equal to one device (measured: max |diff| 0 over 300 batches; rtol=2e-2, atol=2e-2 * max|grad|
    # before)
    _catches_wrong_grads(merged, equal_to_one_device)

    def off(grads: list[torch.Tensor]) -> float:
        return sum(((a - r).double() ** 2).sum() for a, r in zip(grads, one)).item() ** 0.5

    # one bf16 product over the 9 rows, cast once, as one device takes it; 1F1B: three, each cast and added
    assert off(merged) < off(base), (off(merged), off(base))


def test_one_process_merged_weights_under_fp16_and_its_scaler_equals_1f1b() -> None:
    g = torch.Generator().manual_seed(5)
    x, y = (
        torch.randn(8, 6, generator=g, dtype=torch.float32),
        torch.randn(8, 3, generator=g, dtype=torch.float32),
    )
    (merged, fired), (base, _) = (_autocast_run(s, x, y, "fp16") for s in ("merged-weights", "1f1b"))
    one, _ = _autocast_run(None, x, y, "fp16")
    assert set(fired.values()) == {1}, fired
    assert all(torch.isfinite(a).all() for a in merged)

    def equal_to_one_device(grads: list[torch.Tensor]) -> None:
        assert all(torch.equal(m, r) for m, r in zip(grads, one, strict=True))

    def near_1f1b(grads: list[torch.Tensor]) -> None:
        for a, b in zip(grads, base, strict=True):
            torch.testing.assert_close(a, b, rtol=0.0, atol=2.0**-8 * b.abs().max().item())

    # bit-equal to one device under the same autocast and loss scale on this batch (over 300 batches: 299
    # bit-equal, one off by up to 8.3e-4 * max|grad|: fp16 rounding of a chunk's values, which one seeded
    # batch keeps
    # out). 1F1B casts and adds three fp16 products where merged-weights takes one: measured within 2.7e-3 *
    # max|grad|
    # over 300 batches (under 6 of fp16's 2**-11 roundings), so 2**-8 (before: rtol=5e-3, atol=5e-3 *
    # max|grad|)
    _catches_wrong_grads(merged, equal_to_one_device)
    _catches_wrong_grads(merged, near_1f1b)


# ---------------------------------------------------------------------- across ranks
def _ranks_worker(rank: int, world: int, port: int, llama: bool) -> None:
    _join(rank, world, port)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(
        7, 5, generator=g, dtype=torch.float64
    )  # 7 rows in 3 micro-batches: 3 + 2 + 2; then 5: 2 + 2 + 1
    y = torch.randn(7, 4, generator=g, dtype=torch.float64)
    model, reference = _seq(), _seq()
    fired = _count_accumulations(model)
    spanned = torchspan.span(model, balance=[2, 2], microbatches=3, schedule="merged-weights")
    for step, rows in enumerate((7, 5), start=1):  # the second step accumulates
        loss = spanned.train_step(x[:rows], y[:rows], nn.MSELoss())
        want = nn.MSELoss()(reference(x[:rows]), y[:rows])
        want.backward()
        torch.testing.assert_close(loss.double(), want.detach(), **LOSS_TOL)
        assert _check(spanned, reference, f"merged-weights {rows} rows", rank) == (2 if rank == 0 else 4)
        held = [name for name, p in model.named_parameters() if not p.is_meta]
        assert {n: fired.get(n) for n in held} == {n: step for n in held}, (
            f"rank {rank}: {fired}"
        )  # merged: once per step
        assert [e.kind for e in spanned.timeline()].count("backward_weight") == 1, f"rank {rank}"
    tied_across_ranks(rank, g, "merged-weights")
    if (
        llama
    ):  # own forward: a tied transformers decoder; stage 0 merges too (no input needs a gradient there)
        from test_ranks_hooks import _llama, _train_and_compare

        counted: dict[str, int] = {}

        def make() -> nn.Module:
            model = _llama()
            _count_accumulations(model, counted)
            return model

        options = dict(devices=["cpu", "cpu"], microbatches=3, schedule="merged-weights")
        _train_and_compare(make, "llama tied merged-weights", rank, world, 40, True, **options)
        projections = {n: c for n, c in counted.items() if n.endswith("proj.weight")}
        assert projections and set(projections.values()) == {3}, (
            f"rank {rank}: {counted}"
        )  # 3 steps of 3 micro-batches: 3 passes
    _leave()


def _has_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


@pytest.mark.slow
def test_two_rank_merged_weights_matches_one_device() -> None:
    _spawn(_ranks_worker, 2, free_port(), _has_transformers(), deadline=180.0)


def _hybrid_worker(rank: int, world: int, port: int, llama: bool) -> None:
    """2 replicas x 2 stages: the data-parallel reduction starts after each stage's merged weight pass."""
    _join(rank, world, port)
    fired: dict[str, int] = {}

    def after(name: str, spanned: Any) -> None:
        if name == "before sequential":  # the model before span: count its accumulations over its one step
            _count_accumulations(spanned, fired)
        elif name == "sequential":  # one merged pass: each held parameter accumulated once
            assert set(fired.values()) == {1} and len(fired) == (2 if rank % 2 == 0 else 4), (
                f"rank {rank}: {fired}"
            )
        else:
            assert "backward_weight" in {e.kind for e in spanned.timeline()}, f"rank {rank}"

    hybrid_runs(rank, "merged-weights", llama, after)
    _leave()


@pytest.mark.slow
def test_two_by_two_hybrid_merged_weights_matches_one_device() -> None:
    _spawn(_hybrid_worker, 4, free_port(), _has_transformers(), deadline=240.0)
