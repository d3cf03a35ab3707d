"""Every rank of a pipeline is given the same batch on every step, or every rank refuses (issue 18, item 7).

A pipeline rank reads its own copy of the batch (the first stage its inputs, the last its targets,
own-forward ranks the whole forward's inputs). ``RankStage.check_same_batch`` compares a fingerprint
of each rank's batch on every training step (not only on the first one and on shape changes), before
any compute, so a rank fed other data of the same shapes refuses on every rank with no gradient in
``.grad``. In process: the fingerprint itself; on 2 gloo ranks: stage functions and the model's own
forward, each refusing a later step's different values, a permuted batch and different targets, then
training on exactly (float64 against one device) once the batches agree again.
"""

from __future__ import annotations

import copy
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_ranks_hooks import Wrapped, _token_ce
from test_ranks_pipeline import TOL, _check, _join, _leave, _spawn
from torch import nn

import torchspan
from torchspan.runtime.ranks import free_port
from torchspan.runtime.ranks.fingerprint import batch_fingerprint


# ---------------------------------------------------------------------- in process: the fingerprint
def _fp(batch: object) -> list[int]:
    return batch_fingerprint(batch)[0].tolist()


def test_equal_batches_have_equal_fingerprints_whatever_the_threads_or_layout() -> None:
    g = torch.Generator().manual_seed(0)
    x, ids = torch.randn(256, 300, generator=g), torch.randint(0, 50, (256, 7), generator=g)
    batch = ([(x,), {"ids": ids, "mask": ids > 3, "use_cache": False}], [ids])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _fp(batch)
        torch.set_num_threads(2)
        two = _fp(batch)
    finally:
        torch.set_num_threads(threads)
    assert one == two
    strided = x.t().contiguous().t()  # the same values, another memory layout
    copied = ([(strided,), {"ids": ids.clone(), "mask": ids > 3, "use_cache": False}], [ids.clone()])
    assert _fp(copied) == one
    assert _fp(([(x,), {"ids": ids, "mask": ids > 3, "use_cache": False, "cache": object()}], [ids])) == _fp(
        ([(x,), {"ids": ids, "mask": ids > 3, "use_cache": False, "cache": object()}], [ids])
    )  # an object leaf counts by its type, not its address
    assert _fp(([torch.zeros(0, 3)], [torch.zeros(0)])) == _fp(([torch.zeros(0, 3)], [torch.zeros(0)]))


def test_any_difference_changes_the_fingerprint() -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 5, generator=g, dtype=torch.float64), torch.randint(0, 4, (12,), generator=g)
    base = _fp(([x], [y]))
    nudged = x.clone()
    nudged[7, 2] = torch.nextafter(nudged[7, 2], torch.tensor(10.0, dtype=torch.float64))  # one ulp
    swapped = x[[1, 0, *range(2, 12)]]  # two rows exchanged: the same values, summed alike
    others = [
        ([nudged], [y]),
        ([swapped], [y]),
        ([x], [y.flip(0)]),
        ([x.float()], [y]),
        ([x[:, :4]], [y]),
        ([x, x], [y]),
        ({"x": x}, [y]),
        ([x], [y, True]),
    ]
    prints = [_fp(o) for o in others]
    assert all(p != base for p in prints), prints
    assert _fp(([x], [y, True])) != _fp(([x], [y, False]))
    assert _fp(([x.bool()], [y])) != _fp(([~x.bool()], [y]))
    assert _fp(([torch.complex(x, x)], [y])) != _fp(([torch.complex(x, -x)], [y]))
    # +1, -2, +1 on three labels in a row: the plain and the position-weighted sums of the bits are unchanged
    assert _fp(([x], [torch.tensor([5, 5, 5])])) != _fp(([x], [torch.tensor([6, 3, 6])]))


def test_a_batch_over_the_crc_size_is_told_apart_by_the_sums_of_its_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over 16 MiB of tensors (an image batch) the values are summed on their own device instead (only two
    int64s leave it); the same batch still agrees whatever the layout and threads, and a changed value or
    order shows."""
    from torchspan.runtime.ranks import fingerprint

    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(12, 5, generator=g, dtype=torch.float64), torch.randint(0, 4, (12,), generator=g)
    crc = _fp(([x], [y]))
    monkeypatch.setattr(fingerprint, "_CRC_BYTES", 0)
    base = _fp(([x], [y]))
    assert base != crc and base == _fp(([x.t().contiguous().t()], [y.clone()]))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert _fp(([x], [y])) == base
    finally:
        torch.set_num_threads(threads)
    nudged = x.clone()
    nudged[3, 1] = torch.nextafter(nudged[3, 1], torch.tensor(10.0, dtype=torch.float64))
    assert all(
        _fp(b) != base for b in (([nudged], [y]), ([x[[1, 0, *range(2, 12)]]], [y]), ([x], [y.flip(0)]))
    )


def test_plain_values_and_containers_count_by_type_and_a_known_structure_is_not_reused_for_another() -> None:
    x, y = torch.arange(12.0).reshape(3, 4), torch.arange(3)
    variants = [1, True, 1.0, -0.0, 0.0, "1", None]
    prints = [_fp(([x], [y, v])) for v in variants]
    assert len({tuple(p) for p in prints}) == len(variants), prints
    assert _fp(((x,), [y])) != _fp(([x], [y])) and _fp({"a": x, "b": y}) != _fp({"b": y, "a": x})
    for first in (
        ([x], [y, 1]),
        ([x], [y, True]),
        ([x, x], [y]),
    ):  # the previous batch's (structure, hash) given
        for batch in ([x], [y, 1.0]), ([x], [y, True]), ([x], [y, 1]):
            assert batch_fingerprint(batch, batch_fingerprint(first)[1])[0].tolist() == _fp(batch)
    from collections import namedtuple  # a pytree node other than tuple, list, dict: the pytree walk

    Pair = namedtuple("Pair", "a b")
    assert _fp(Pair(x, y)) != _fp((x, y)) and _fp(Pair(x, y)) == _fp(Pair(x.clone(), y.clone()))


# ---------------------------------------------------------------------- 2 ranks
def _refused(
    spanned: torchspan.Spanned, inputs: object, target: torch.Tensor, loss_fn, label: str, **kw
) -> str:  # type: ignore[no-untyped-def]
    """One train_step that must be refused before any gradient reaches .grad on this rank."""
    spanned.zero_grad(set_to_none=True)
    before = {n: p.detach().clone() for n, p in spanned.module.named_parameters() if p.device.type != "meta"}
    try:
        spanned.train_step(inputs, target, loss_fn, **kw)
    except ValueError as exc:
        text = str(exc)
    else:
        return f"{label}: no error"
    for name, p in spanned.module.named_parameters():
        if p.device.type != "meta":
            assert p.grad is None, f"{label}: {name} has a gradient after the refusal"
            assert torch.equal(p.detach(), before[name])
    return f"{label}: {text}"


def _sequential_case(rank: int, texts: list[str]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 6), nn.Linear(6, 4)).double()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, balance=[2, 2], microbatches=2, schedule="1f1b")
    g = torch.Generator().manual_seed(3)
    x, y = (
        torch.randn(6, 5, generator=g, dtype=torch.float64),
        torch.randn(6, 4, generator=g, dtype=torch.float64),
    )
    loss_fn = nn.MSELoss()
    spanned.train_step(x, y, loss_fn)  # the first step: the same batch everywhere
    other = x.clone()
    if rank == 1:
        other[4, 1] += 1e-9  # a later step, the same shapes, one value differs on rank 1
    texts.append(_refused(spanned, other, y, loss_fn, "sequential values"))
    permuted = x[[0, 1, 2, 3, 5, 4]] if rank == 1 else x  # rank 1 shuffled its rows
    texts.append(_refused(spanned, permuted, y, loss_fn, "sequential rows"))
    targets = y + (1.0 if rank == 0 else 0.0)  # the first stage's targets differ: the last stage's are read
    texts.append(_refused(spanned, x, targets, loss_fn, "sequential targets"))
    spanned.zero_grad(set_to_none=True)
    loss = spanned.train_step(x, y, loss_fn)  # the batches agree again: an exact step
    want = loss_fn(reference(x), y)
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-6, atol=1e-7)
    assert _check(spanned, reference, "sequential after the refusals", rank) == 2 + 2 * (rank == 1)


def _own_forward_case(rank: int, texts: list[str]) -> None:
    model = Wrapped()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, balance=[3, 3], microbatches=2)
    assert spanned.mode == "own-forward"
    g = torch.Generator().manual_seed(4)
    ids, labels = torch.randint(0, 30, (4, 5), generator=g), torch.randint(0, 30, (4, 5), generator=g)
    mask = torch.ones(4, 5, dtype=torch.float64)
    spanned.train_step({"ids": ids, "mask": mask}, labels, _token_ce, loss_reduction="mean")
    other = mask.clone()
    if rank == 0:
        other[2, 4] = 0.0  # rank 0 pads one more token: the same shapes
    texts.append(
        _refused(
            spanned, {"ids": ids, "mask": other}, labels, _token_ce, "own-forward mask", loss_reduction="mean"
        )
    )
    spanned.zero_grad(set_to_none=True)
    seen: list[str] = []
    broadcast, all_gather = dist.broadcast, dist.all_gather
    dist.broadcast = lambda *a, **k: (seen.append("broadcast"), broadcast(*a, **k))[1]  # type: ignore[assignment]
    dist.all_gather = lambda *a, **k: (
        seen.append(f"all_gather async={k.get('async_op')}"),
        all_gather(*a, **k),
    )[1]  # type: ignore[assignment]
    try:
        loss = spanned.train_step({"ids": ids, "mask": mask}, labels, _token_ce, loss_reduction="mean")
    finally:
        dist.broadcast, dist.all_gather = broadcast, all_gather  # type: ignore[assignment]
    # the loss rides after the last gradient message (no broadcast), the batch check overlaps the compute
    assert seen == ["all_gather async=True"], seen
    want = _token_ce(reference(ids, mask=mask), labels)
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-6, atol=1e-7)
    for name, p in spanned.module.named_parameters():
        if p.device.type != "meta":
            torch.testing.assert_close(p.grad, dict(reference.named_parameters())[name].grad, **TOL)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    _join(rank, world, port)
    texts: list[str] = []
    try:
        _sequential_case(rank, texts)
        _own_forward_case(rank, texts)
    except BaseException:
        texts.append("FAILED " + traceback.format_exc())
    Path(out, f"rank{rank}.txt").write_text("\n".join(texts))
    _leave()


@pytest.mark.slow
def test_pipeline_ranks_given_another_batch_on_a_later_step_refuse_before_any_gradient(
    tmp_path: Path,
) -> None:
    _spawn(_worker, 2, free_port(), str(tmp_path), deadline=150.0)
    for rank in range(2):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        assert "FAILED" not in text, text
        for label in ("sequential values", "sequential rows", "sequential targets", "own-forward mask"):
            assert (
                f"{label}: rank(s) [1] of pipeline replica 0 were given another batch than rank 0" in text
            ), f"rank {rank}: {text}"
