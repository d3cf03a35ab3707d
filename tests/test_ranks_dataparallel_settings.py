"""A launched ``span(model)`` (a data-parallel replica per rank) takes ``microbatches=``, ``precision=`` and
``recompute=`` as a local span does (issue 18, item 3).

Two gloo ranks on 127.0.0.1, uneven shards (7 rows = 4 + 3, shards smaller than ``microbatches``, an
empty shard). float64 cases are compared with one device on the whole global batch; bf16 and fp16
with the same autocast in one process on the same chunks (and bf16 loosely with the whole batch):

- **micro-batches**: gradient accumulation inside each rank's shard, weighed against the global
  normalizer (mean, sum, class-weighted and padded cross-entropy, a declared normalizer); one
  gradient all-reduce per step (DDP's ``no_sync`` for all but the last chunk);
- **recompute**: every layer recomputed in backward (``always``, ``except_last``), the same gradients;
  a small GPT-2 (blocks) with micro-batches and recompute;
- **bf16**: autocast of each chunk's forward and loss on the rank's device;
- **fp16**: the plain loop (``optimizer.step()``) equals autocast + ``GradScaler`` in one process; a
  step that overflows on one rank's shard only is skipped on every rank (the scaler reads the
  all-reduced gradients), the scale backs off alike.
"""

from __future__ import annotations

import copy
import os
import traceback
from pathlib import Path

import pytest
import torch
from test_ranks_pipeline import _leave, _spawn
from torch import nn

import torchspan
from torchspan.runtime.fp16 import SpanScaler
from torchspan.runtime.ranks import free_port, shard_batch

TOL = dict(rtol=1e-10, atol=1e-12)
LOSS_TOL = dict(rtol=1e-6, atol=1e-7)


class Count(nn.Module):
    """tanh, counting its forward calls (a recomputed forward calls it again)."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Count.calls += 1
        return torch.tanh(x)


def _mlp(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), Count(), nn.Linear(8, 4)).to(dtype)


def _grads(spanned: torchspan.Spanned, reference: nn.Module, label: str, **tol: float) -> None:
    ref = dict(reference.named_parameters())
    for name, p in spanned.module.named_parameters():
        assert p.grad is not None, f"{label}: {name} has no gradient"
        torch.testing.assert_close(
            p.grad, ref[name].grad, **(tol or TOL), msg=lambda m: f"{label}: {name}: {m}"
        )


def _step(rank: int, x, y, loss_fn, label: str, model=None, reference=None, **options):  # type: ignore[no-untyped-def]
    """One train_step of a fresh span on this rank's shard against one device on the whole batch."""
    model = model if model is not None else _mlp()
    reference = reference if reference is not None else copy.deepcopy(model)
    declared = {k: options.pop(k) for k in ("loss_reduction", "loss_normalizer") if k in options}
    spanned = torchspan.span(model, **options)
    assert spanned.mode == "data-parallel", label
    got = spanned.train_step(*shard_batch((x, y), rank, 2), loss_fn, **declared)
    want = loss_fn(reference(x), y)
    want.backward()
    torch.testing.assert_close(
        got.double(), want.detach().double(), **LOSS_TOL, msg=lambda m: f"{label}: loss: {m}"
    )
    _grads(spanned, reference, label)
    return spanned


def _microbatch_cases(rank: int) -> None:
    g = torch.Generator().manual_seed(7)
    x, y = (
        torch.randn(7, 5, generator=g, dtype=torch.float64),
        torch.randn(7, 4, generator=g, dtype=torch.float64),
    )
    labels = torch.tensor([0, 3, 3, 1, 2, 3, 0])
    padded = torch.tensor([0, 1, 3, 2, -1, -1, -1])  # rank 1's rows are all padding
    weights = torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=torch.float64)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU]
    ) as prof:  # DDP's own all-reduces too
        spanned = _step(rank, x, y, nn.MSELoss(), "mse mean, 3 micro-batches", microbatches=3)
    reduces = [e.name for e in prof.events() if e.name == "gloo:all_reduce"]
    assert len(reduces) == 2, (
        f"normalizers and ONE gradient bucket (the loss rides in it) expected, got {len(reduces)} all-reduces"
    )
    assert spanned.microbatches == 3 and [e.kind for e in spanned.timeline()] == ["forward", "backward"] * 3
    _step(rank, x, y, nn.MSELoss(reduction="sum"), "mse sum, 2 micro-batches", microbatches=2)
    _step(
        rank, x, labels, nn.CrossEntropyLoss(weight=weights), "class-weighted cross-entropy", microbatches=2
    )
    _step(
        rank,
        x,
        padded,
        nn.CrossEntropyLoss(weight=weights, ignore_index=-1),
        "weighted + padded",
        microbatches=3,
    )
    _step(rank, x[:3], y[:3], nn.MSELoss(), "shards of 2 and 1 rows, 4 micro-batches", microbatches=4)
    _step(rank, x[:1], y[:1], nn.MSELoss(), "an empty shard on rank 1", microbatches=2)

    # several optimizer steps with accumulation over two train_steps: identical replicas, one device's weights
    model = _mlp()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, microbatches=2)
    opt, ref_opt = (
        torch.optim.Adam(spanned.parameters(), lr=0.05),
        torch.optim.Adam(reference.parameters(), lr=0.05),
    )
    for n in (7, 6, 5):
        opt.zero_grad()
        ref_opt.zero_grad()
        for rows in (slice(0, n), slice(0, n - 2)):
            spanned.train_step(*shard_batch((x[rows], labels[rows]), rank, 2), nn.CrossEntropyLoss())
            nn.CrossEntropyLoss()(reference(x[rows]), labels[rows]).backward()
        opt.step()
        ref_opt.step()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(
            dict(spanned.module.named_parameters())[name].detach(), p.detach(), rtol=1e-9, atol=1e-11
        )


def _opaque_cases(rank: int) -> None:
    """Losses torchspan calibrates or verifies (a lambda, a declared normalizer or reduction) with
    micro-batches."""
    g = torch.Generator().manual_seed(11)
    x, y = (
        torch.randn(7, 5, generator=g, dtype=torch.float64),
        torch.randn(7, 4, generator=g, dtype=torch.float64),
    )
    padded = torch.tensor([0, 1, 3, 2, -1, 2, -1])
    token_mean = lambda out, t: (
        nn.functional.cross_entropy(out, t, ignore_index=-1, reduction="sum") / (t != -1).sum()
    )  # noqa: E731
    _step(
        rank,
        x,
        padded,
        token_mean,
        "lambda + loss_normalizer",
        microbatches=2,
        loss_normalizer=lambda t: (t != -1).sum(),
    )
    _step(rank, x, y, lambda out, t: ((out - t) ** 2).mean(), "lambda mean, calibrated", microbatches=2)
    _step(
        rank,
        x,
        y,
        lambda out, t: ((out - t) ** 2).sum(),
        "lambda sum, declared",
        microbatches=3,
        loss_reduction="sum",
    )


def _recompute_cases(rank: int) -> None:
    g = torch.Generator().manual_seed(8)
    x, y = (
        torch.randn(7, 5, generator=g, dtype=torch.float64),
        torch.randn(7, 4, generator=g, dtype=torch.float64),
    )
    rows = 4 if rank == 0 else 3
    for mode, m in (("always", 1), ("always", 2), ("except_last", 3)):
        model = _mlp()
        reference = copy.deepcopy(model)
        Count.calls = 0
        spanned = _step(
            rank,
            x,
            y,
            nn.MSELoss(),
            f"recompute={mode}, {m} micro-batches",
            model,
            reference,
            microbatches=m,
            recompute=mode,
        )
        assert spanned.recompute == mode
        chunks = min(m, rows)
        again = chunks if mode == "always" else chunks - 1  # forwards recomputed in backward
        assert Count.calls == chunks + again + 1, (
            f"recompute={mode}: {Count.calls} tanh calls"
        )  # + the reference's one


def _gpt2_case(rank: int) -> None:
    """A small GPT-2 trained on its own loss (labels in the batch) with micro-batches and every block
    recomputed."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        vocab_size=40,
        n_positions=16,
        n_embd=16,
        n_layer=3,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    torch.manual_seed(1)
    model = transformers.GPT2LMHeadModel(cfg).double()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(0, 40, (5, 6), generator=g)
    labels = ids.clone()
    labels[3:, 4:] = -100  # padding in rank 1's rows only
    spanned = torchspan.span(model, microbatches=2, recompute="always")
    calls = {"block": 0, "mlp": 0}
    block = spanned.module.transformer.h[1]
    block.register_forward_pre_hook(lambda *a: calls.__setitem__("block", calls["block"] + 1))
    block.mlp.register_forward_pre_hook(lambda *a: calls.__setitem__("mlp", calls["mlp"] + 1))
    got = spanned.train_step(shard_batch({"input_ids": ids, "labels": labels}, rank, 2))
    want = reference(input_ids=ids, labels=labels).loss
    want.backward()
    torch.testing.assert_close(got.double(), want.detach().double(), **LOSS_TOL)
    _grads(spanned, reference, "GPT-2, own loss, 2 micro-batches, blocks recomputed")
    assert calls["mlp"] - calls["block"] == 2, (
        calls
    )  # each chunk's block forward ran again inside its backward


def _chunk_reference(
    model: nn.Module, x, y, rank_chunks: list[list[slice]], dtype: torch.dtype, scaler=None
) -> None:  # type: ignore[no-untyped-def]
    """One process, the ranks' chunks one after another, each autocast with its loss weighed by its rows / all
    rows."""
    for chunks in rank_chunks:
        for rows in chunks:
            with torch.autocast("cpu", dtype=dtype):
                loss = nn.functional.mse_loss(model(x[rows]), y[rows]) * ((rows.stop - rows.start) / len(x))
            (scaler.scale(loss) if scaler is not None else loss).backward()


CHUNKS = [
    [slice(0, 2), slice(2, 4)],
    [slice(4, 6), slice(6, 7)],
]  # 7 rows: rank 0's 4 in 2 + 2, rank 1's 3 in 2 + 1


def _bf16_case(rank: int) -> None:
    g = torch.Generator().manual_seed(9)
    x, y = torch.randn(7, 5, generator=g), torch.randn(7, 4, generator=g)
    for recompute in ("never", "always"):
        model = _mlp(torch.float32)
        same, whole = copy.deepcopy(model), copy.deepcopy(model)
        spanned = torchspan.span(model, microbatches=2, precision="bf16", recompute=recompute)
        spanned.train_step(*shard_batch((x, y), rank, 2), nn.functional.mse_loss)
        _chunk_reference(same, x, y, CHUNKS, torch.bfloat16)
        _grads(
            spanned,
            same,
            f"bf16 recompute={recompute}: the same autocast on the same chunks",
            rtol=1e-5,
            atol=1e-6,
        )
        with torch.autocast("cpu", dtype=torch.bfloat16):
            nn.functional.mse_loss(whole(x), y).backward()
        _grads(spanned, whole, f"bf16 recompute={recompute}: the whole batch in bf16", rtol=5e-2, atol=5e-3)
        assert next(spanned.parameters()).grad.dtype == torch.float32


def _fp16_case(rank: int) -> None:
    model = _mlp(torch.float32)
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, microbatches=2, precision="fp16")
    assert isinstance(spanned.scaler, SpanScaler)
    opt = torch.optim.SGD(spanned.parameters(), lr=0.05)
    ref_opt, ref_scaler = torch.optim.SGD(reference.parameters(), lr=0.05), torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(10)
    for step in range(4):
        x, y = torch.randn(7, 5, generator=g), torch.randn(7, 4, generator=g)
        if step == 1:
            y[6] *= 1e5  # rank 1's shard only: its fp16 gradients overflow at 65536
        opt.zero_grad()
        spanned.train_step(*shard_batch((x, y), rank, 2), nn.functional.mse_loss)
        opt.step()  # the plain loop: no scaler call
        ref_opt.zero_grad()
        _chunk_reference(reference, x, y, CHUNKS, torch.float16, ref_scaler)
        skipped = ref_scaler.get_scale()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        if step == 1:
            assert ref_scaler.get_scale() == skipped / 2, "the reference did not overflow"
        _same_weights(spanned, reference, ref_scaler, f"fp16 step {step}")
    # an uneven epoch end: rank 0 trains two more steps alone (the second overflows), rank 1 shadows them
    for step, scale in ((4, 1.0), (5, 1e5)):
        x, y = torch.randn(3, 5, generator=g), torch.randn(3, 4, generator=g) * scale
        if rank == 0:
            opt.zero_grad()
            spanned.train_step(x, y, nn.functional.mse_loss)
            opt.step()
        ref_opt.zero_grad()
        _chunk_reference(
            reference, torch.cat([x, x[:0]]), y, [[slice(0, 2), slice(2, 3)]], torch.float16, ref_scaler
        )
        ref_scaler.step(ref_opt)
        ref_scaler.update()
    assert spanned.join(opt) == (0 if rank == 0 else 2)
    _same_weights(spanned, reference, ref_scaler, "fp16 after join")


def _same_weights(spanned: torchspan.Spanned, reference: nn.Module, ref_scaler, label: str) -> None:  # type: ignore[no-untyped-def]
    assert spanned.scaler.get_scale() == ref_scaler.get_scale(), f"{label}: scale"
    for name, p in reference.named_parameters():
        mine = dict(spanned.module.named_parameters())[name].detach()
        torch.testing.assert_close(
            mine, p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{label}: {name}: {m}"
        )


CASES = (_microbatch_cases, _recompute_cases, _gpt2_case, _bf16_case, _fp16_case)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    torchspan.init_distributed(timeout=60)
    done = []
    try:
        for case in CASES:
            case(rank)
            done.append(case.__name__)
    except BaseException:
        done.append("FAILED " + traceback.format_exc())
    try:  # last: a failure here leaves the other cases' verdicts alone
        _opaque_cases(rank)
        opaque = "ok"
    except BaseException:
        opaque = "FAILED " + traceback.format_exc()
    Path(out, f"rank{rank}.txt").write_text("\n".join(done))
    Path(out, f"opaque{rank}.txt").write_text(opaque)
    _leave()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-rank job running every case; each rank writes what passed."""
    out = tmp_path_factory.mktemp("dp_settings")
    _spawn(_worker, 2, free_port(), str(out), deadline=240.0)
    return out


@pytest.mark.slow
def test_a_launched_replica_takes_microbatches_precision_and_recompute(ranks: Path) -> None:
    for rank in range(2):
        text = (ranks / f"rank{rank}.txt").read_text()
        assert "FAILED" not in text, f"rank {rank}:\n{text}"
        assert text.split() == [case.__name__ for case in CASES], text


@pytest.mark.slow
def test_opaque_and_declared_losses_with_microbatches(ranks: Path) -> None:
    for rank in range(2):
        text = (ranks / f"opaque{rank}.txt").read_text()
        assert text == "ok", f"rank {rank}:\n{text}"


def test_a_bare_replica_refuses_unknown_settings_and_fp16_without_a_scaler() -> None:
    from torchspan.runtime.ranks.dataparallel import _check_policy

    with pytest.raises(ValueError, match="precision='fp8' is not one of '32', 'bf16', 'fp16'"):
        _check_policy("fp8", "never", None)
    with pytest.raises(ValueError, match="recompute='sometimes' is not one of"):
        _check_policy("32", "sometimes", None)
    with pytest.raises(
        ValueError, match=r"precision='fp16' needs a gradient scaler: pass scaler=torch.amp.GradScaler"
    ):
        _check_policy("fp16", "never", None)
    _check_policy("fp16", "always", torch.amp.GradScaler("cpu"))
