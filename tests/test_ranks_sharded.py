"""Sharded data parallel is exact: ``span(model, shard=True)`` (FSDP2 under torchspan's loss contract, issue
20).

One job of two gloo ranks on 127.0.0.1 runs every case (each writes its verdict, one test per case) and
one job of four runs uneven and empty shards: the full gradient (``.grad.full_tensor()``) equals one
device's on the whole global batch in float64, for uneven shards (7 rows = 4 + 3), an empty shard,
class weights with ``ignore_index``, opaque and declared losses (a calibration a rank needs while
another does not), micro-batches (one reduce-scatter per unit per step), recompute, ZeRO-2,
``join(optimizer)``, ``clip_grad_norm_``, a tied Llama on its own loss; bf16 against the same mixed
precision in one process (each rank's shard in bf16, its gradient cast to float32 and summed: what
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)`` computes, so equal to rounding of
the sum of two terms) and loosely against float32; each rank's shard bytes ~1/N of parameters,
gradients and Adam state; the full state dict after a step equal to one device's, loaded back.
"""

from __future__ import annotations

import copy
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_ranks_pipeline import _leave, _spawn
from torch import nn
from torch.distributed.tensor import DTensor

import torchspan
from torchspan.runtime.ranks import free_port, shard_batch
from torchspan.runtime.ranks.sharded import local_bytes

TOL = dict(rtol=1e-10, atol=1e-12)
LOSS_TOL = dict(rtol=1e-6, atol=1e-7)
OWN_LOSS_TOL = dict(rtol=1e-5, atol=1e-7)  # transformers compute their own loss in float32


class Count(nn.Module):
    """tanh, counting its forward calls (a recomputed forward calls it again)."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Count.calls += 1
        return torch.tanh(x)


def _mlp(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), Count(), nn.Linear(8, 4)).to(dtype)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _grads(spanned: torchspan.Spanned, reference: nn.Module, label: str, **tol: float) -> None:
    ref = dict(reference.named_parameters())
    for name, p in spanned.module.named_parameters():
        assert isinstance(p, DTensor), f"{label}: {name} is not sharded"
        assert p.grad is not None, f"{label}: {name} has no gradient"
        torch.testing.assert_close(
            _full(p.grad), ref[name].grad, **(tol or TOL), msg=lambda m: f"{label}: {name}: {m}"
        )


def _weights(spanned: torchspan.Spanned, reference: nn.Module, label: str, **tol: float) -> None:
    ref = dict(reference.named_parameters())
    for name, p in spanned.module.named_parameters():
        torch.testing.assert_close(
            _full(p.detach()),
            ref[name].detach(),
            **(tol or dict(rtol=1e-9, atol=1e-11)),
            msg=lambda m: f"{label}: {name}: {m}",
        )


def _step(rank: int, world: int, x, y, loss_fn, label: str, model=None, reference=None, **options):  # type: ignore[no-untyped-def]
    """One train_step of a fresh sharded span on this rank's shard against one device on the whole batch."""
    model = model if model is not None else _mlp()
    reference = reference if reference is not None else copy.deepcopy(model)
    declared = {k: options.pop(k) for k in ("loss_reduction", "loss_normalizer") if k in options}
    spanned = torchspan.span(model, shard=True, **options)
    assert spanned.mode == "sharded" and spanned.offload is None, label
    got = spanned.train_step(*shard_batch((x, y), rank, world), loss_fn, **declared)
    want = loss_fn(reference(x), y)
    want.backward()
    torch.testing.assert_close(
        got.double(), want.detach().double(), **LOSS_TOL, msg=lambda m: f"{label}: loss: {m}"
    )
    _grads(spanned, reference, label)
    return spanned


def _data(seed: int = 7, dtype: torch.dtype = torch.float64):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(7, 5, generator=g, dtype=dtype), torch.randn(7, 4, generator=g, dtype=dtype)


LABELS = torch.tensor([0, 3, 3, 1, 2, 3, 0])
PADDED = torch.tensor([0, 1, 3, 2, -1, -1, -1])  # rank 1's rows (4, 5, 6) are all padding
CLASS_WEIGHTS = torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=torch.float64)


# ---------------------------------------------------------------------------------------------- cases
def _losses(rank: int, world: int) -> None:
    x, y = _data()
    _step(rank, world, x, y, nn.MSELoss(), "mse mean, uneven")
    _step(rank, world, x, y, nn.MSELoss(reduction="sum"), "mse sum, uneven")
    _step(rank, world, x, LABELS, nn.CrossEntropyLoss(weight=CLASS_WEIGHTS), "class-weighted cross-entropy")
    _step(rank, world, x, PADDED, nn.CrossEntropyLoss(ignore_index=-1), "padded cross-entropy")
    _step(
        rank,
        world,
        x,
        PADDED,
        nn.CrossEntropyLoss(weight=CLASS_WEIGHTS, ignore_index=-1),
        "weighted + padded",
    )
    _step(
        rank,
        world,
        x,
        PADDED,
        nn.CrossEntropyLoss(weight=CLASS_WEIGHTS, ignore_index=-1),
        "ZeRO-2",
        reshard_after_forward=False,
    )
    _step(rank, world, x[:1], y[:1], nn.MSELoss(), "empty shard on rank 1")
    _step(rank, world, x, LABELS, nn.functional.cross_entropy, "functional cross-entropy")
    token_mean = lambda out, t: (
        nn.functional.cross_entropy(out, t, ignore_index=-1, reduction="sum") / (t != -1).sum()
    )  # noqa: E731
    _step(
        rank,
        world,
        x[:5],
        PADDED[:5],
        token_mean,
        "lambda with loss_normalizer",
        loss_normalizer=lambda t: (t != -1).sum(),
    )
    _step(
        rank,
        world,
        x,
        y,
        lambda out, t: ((out - t) ** 2).sum(),
        "lambda declared as a sum",
        loss_reduction="sum",
    )


def _calibrations(rank: int, world: int) -> None:
    """An opaque loss calibrated on each shard: a dry forward gathers parameters, so when one rank's batch
    structure is new and the other's is not, both still run it (the case that would hang if each rank decided
    alone)."""
    x, y = _data(8)
    model = _mlp()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, shard=True)
    mean = lambda out, t: ((out - t) ** 2).mean()  # noqa: E731
    for step, rows in enumerate((7, 6, 6, 5, 1)):  # shards 4+3, 3+3 (new on rank 0 only), 3+3, 3+2, 1+0
        spanned.module.zero_grad()
        reference.zero_grad()
        got = spanned.train_step(*shard_batch((x[:rows], y[:rows]), rank, world), mean)
        want = mean(reference(x[:rows]), y[:rows])
        want.backward()
        torch.testing.assert_close(got, want.detach(), **LOSS_TOL)
        _grads(spanned, reference, f"calibrated lambda, step {step} ({rows} rows)")
    with pytest.raises(ValueError, match="is not a per-sample mean or a sum"):
        spanned.train_step(*shard_batch((x, y), rank, world), lambda out, t: ((out - t) ** 2).mean().sqrt())


def _microbatches(rank: int, world: int) -> None:
    x, y = _data()
    counts = []
    real = dist.reduce_scatter_single
    dist.reduce_scatter_single = lambda *a, **k: counts.append(1) or real(*a, **k)  # type: ignore[assignment]
    try:
        _step(rank, world, x, y, nn.MSELoss(), "mse, 1 micro-batch")
        one = len(counts)
        counts.clear()
        _step(rank, world, x, y, nn.MSELoss(), "mse, 3 micro-batches", microbatches=3)
    finally:
        dist.reduce_scatter_single = real  # type: ignore[assignment]
    assert one == 2 and len(counts) == one, (
        f"one reduce-scatter per unit per step expected: {one} then {len(counts)}"
    )
    _step(
        rank,
        world,
        x,
        PADDED,
        nn.CrossEntropyLoss(weight=CLASS_WEIGHTS, ignore_index=-1),
        "weighted + padded, 3",
        microbatches=3,
    )
    _step(rank, world, x[:3], y[:3], nn.MSELoss(), "shards of 2 and 1 rows, 4 micro-batches", microbatches=4)
    _step(rank, world, x[:1], y[:1], nn.MSELoss(), "an empty shard, 2 micro-batches", microbatches=2)
    # accumulation over two train_steps and Adam steps: one device's weights
    model = _mlp()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, shard=True, microbatches=2)
    opt, ref_opt = (
        torch.optim.Adam(spanned.parameters(), lr=0.05),
        torch.optim.Adam(reference.parameters(), lr=0.05),
    )
    for n in (7, 6, 5):
        opt.zero_grad()
        ref_opt.zero_grad()
        for rows in (slice(0, n), slice(0, n - 2)):
            spanned.train_step(*shard_batch((x[rows], LABELS[rows]), rank, world), nn.CrossEntropyLoss())
            nn.CrossEntropyLoss()(reference(x[rows]), LABELS[rows]).backward()
        opt.step()
        ref_opt.step()
    _weights(spanned, reference, "Adam after accumulation")


def _recompute(rank: int, world: int) -> None:
    x, y = _data(9)
    rows = 4 if rank == 0 else 3
    for mode, m in (("always", 1), ("always", 2), ("except_last", 3)):
        Count.calls = 0
        spanned = _step(
            rank,
            world,
            x,
            y,
            nn.MSELoss(),
            f"recompute={mode}, {m} micro-batches",
            microbatches=m,
            recompute=mode,
        )
        chunks = min(m, rows)
        again = chunks if mode == "always" else chunks - 1
        assert spanned.recompute == mode and Count.calls == chunks + again + 1, (
            f"recompute={mode}: {Count.calls} tanh calls"
        )


def _join(rank: int, world: int) -> None:
    """Uneven epoch ends: rank 0 has a third batch, the others join and shadow it with a stand-in row."""
    g = torch.Generator().manual_seed(10)
    x, y = (
        torch.randn(2 * world + 3, 5, generator=g, dtype=torch.float64),
        torch.randn(2 * world + 3, 4, generator=g, dtype=torch.float64),
    )
    model = _mlp()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, shard=True)
    opt = torch.optim.SGD(spanned.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    batches = [
        (x[world * s + rank : world * s + rank + 1], y[world * s + rank : world * s + rank + 1])
        for s in range(2)
    ]
    if rank == 0:
        batches.append((x[2 * world :], y[2 * world :]))
    for rows, target in batches:
        opt.zero_grad()
        spanned.train_step(rows, target, nn.MSELoss())
        opt.step()
    for rows in (slice(0, world), slice(world, 2 * world), slice(2 * world, None)):
        ref_opt.zero_grad()
        nn.MSELoss()(reference(x[rows]), y[rows]).backward()
        ref_opt.step()
    assert spanned.join(opt) == (0 if rank == 0 else 1)
    _weights(spanned, reference, "after join")


def _clip(rank: int, world: int) -> None:
    x, y = _data(11)
    model = _mlp()
    reference = copy.deepcopy(model)
    spanned = _step(
        rank,
        world,
        x,
        PADDED,
        nn.CrossEntropyLoss(weight=CLASS_WEIGHTS, ignore_index=-1),
        "before clipping",
        model,
        reference,
    )
    for norm_type, max_norm in ((2.0, 0.05), (float("inf"), 0.01), (1.0, 0.02), (3.0, 1e3)):
        got = spanned.clip_grad_norm_(max_norm, norm_type)
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
        assert not isinstance(got, DTensor)
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"norm_type={norm_type}: {m}")
        _grads(spanned, reference, f"clipped, norm_type={norm_type}")


def _state(rank: int, world: int) -> None:
    x, y = _data(12)
    model = _mlp()
    reference = copy.deepcopy(model)
    keys = list(reference.state_dict())
    spanned = torchspan.span(model, shard=True)
    opt, ref_opt = (
        torch.optim.Adam(spanned.parameters(), lr=0.1),
        torch.optim.Adam(reference.parameters(), lr=0.1),
    )
    spanned.train_step(*shard_batch((x, y), rank, world), nn.MSELoss())
    nn.MSELoss()(reference(x), y).backward()
    opt.step()
    ref_opt.step()
    full = spanned.state_dict()
    assert list(full) == keys, list(full)
    for key, value in reference.state_dict().items():
        assert type(full[key]) is torch.Tensor, f"{key} is {type(full[key]).__name__}"
        torch.testing.assert_close(full[key], value, rtol=1e-9, atol=1e-11, msg=lambda m: f"{key}: {m}")
    sharded = spanned.module.state_dict()  # the sharded form: the same keys, each rank's shard
    assert list(sharded) == keys and all(isinstance(v, DTensor) for v in sharded.values())
    other = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    spanned.load_state_dict(other.state_dict())
    for key, value in spanned.state_dict().items():
        torch.testing.assert_close(
            value, other.state_dict()[key], rtol=0, atol=0, msg=lambda m: f"loaded {key}: {m}"
        )
    spanned.load_state_dict(
        {"module." + k: v for k, v in reference.state_dict().items()}
    )  # a DDP checkpoint's keys
    _weights(spanned, reference, "loaded with a module. prefix", rtol=0, atol=0)


def _memory(rank: int, world: int) -> None:
    """Each rank holds ~1/N of parameters, gradients and Adam state (local shard bytes); together exactly
    all."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 7))
    full = sum(p.numel() * 4 for p in model.parameters())
    spanned = torchspan.span(model, shard=True)
    opt = torch.optim.Adam(spanned.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(13)
    x, labels = torch.randn(9, 64, generator=g), torch.randint(0, 7, (9,), generator=g)
    spanned.train_step(*shard_batch((x, labels), rank, world), nn.CrossEntropyLoss())
    opt.step()
    mine = local_bytes(spanned.module, opt)
    everyone: list[dict[str, int]] = [{} for _ in range(world)]
    dist.all_gather_object(everyone, mine)
    for kind, total in (("params", full), ("grads", full), ("optimizer", 2 * full)):
        assert sum(r[kind] for r in everyone) == total, (kind, everyone, total)
        assert mine[kind] <= total / world * 1.05, (
            f"rank {rank} holds {mine[kind]} of {total} {kind} bytes over {world} ranks"
        )
    reported = spanned.memory(opt)[0]  # Spanned.memory counts the local shards too
    assert (reported["params"], reported["grads"]) == (mine["params"], mine["grads"]), (reported, mine)


def _llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double()


def _tied_llama(rank: int, world: int) -> None:
    """A tied Llama on its own loss (labels in the batch), micro-batches, blocks recomputed, AdamW steps, then
    an empty shard."""
    model = _llama()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, shard=True, microbatches=2, recompute="always")
    assert model.lm_head.weight is model.model.embed_tokens.weight and isinstance(
        model.lm_head.weight, DTensor
    )
    assert len(list(spanned.parameters())) == len(list(reference.parameters()))
    g = torch.Generator().manual_seed(14)
    ids = torch.randint(0, 64, (5, 9), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    labels[3, 5:] = -100  # padding on both ranks' shards (3 + 2 rows)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    opt, ref_opt = (
        torch.optim.AdamW(spanned.parameters(), lr=0.01),
        torch.optim.AdamW(reference.parameters(), lr=0.01),
    )
    for step, rows in enumerate((5, 1)):  # 3 + 2 rows, then 1 + 0: rank 1's shard is empty
        part = {k: v[:rows] for k, v in batch.items()}
        got = spanned.train_step(shard_batch(part, rank, world))
        want = reference(**part).loss
        want.backward()
        torch.testing.assert_close(got.double(), want.detach().double(), **OWN_LOSS_TOL)
        _grads(spanned, reference, f"tied Llama, own loss, step {step}", **OWN_LOSS_TOL)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        full = spanned.state_dict()
        assert list(full) == list(reference.state_dict())
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(
                full[key], value, rtol=1e-6, atol=1e-8, msg=lambda m: f"step {step}: {key}: {m}"
            )
    held = local_bytes(spanned.module)["params"]
    assert held <= local_bytes(reference)["params"] / world * 1.05, held


def _bf16_reference(model: nn.Module, x, y, rank_chunks: list[list[slice]]) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """What FSDP2's bf16 policy computes: every chunk in bf16 (parameters and inputs cast, outputs back to
    float32, the loss weighed by its rows over all rows), each chunk's bf16 gradient cast to float32 and
    accumulated in float32 on its rank, the ranks' gradients summed (in rank order, as the reduce-scatter adds
    two terms)."""
    half = copy.deepcopy(model).to(torch.bfloat16)
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for chunks in rank_chunks:
        mine = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        for rows in chunks:
            half.zero_grad()
            out = half(x[rows].to(torch.bfloat16)).float()
            (nn.functional.mse_loss(out, y[rows]) * ((rows.stop - rows.start) / len(x))).backward()
            for n, p in half.named_parameters():
                mine[n] += p.grad.float()
        for n in total:
            total[n] += mine[n]
    return total


def _bf16(rank: int, world: int) -> None:
    x, y = _data(15, torch.float32)
    for m, chunks in (
        (1, [[slice(0, 4)], [slice(4, 7)]]),
        (2, [[slice(0, 2), slice(2, 4)], [slice(4, 6), slice(6, 7)]]),
    ):
        model = _mlp(torch.float32)
        whole = copy.deepcopy(model)
        want = _bf16_reference(model, x, y, chunks)
        spanned = torchspan.span(model, shard=True, precision="bf16", microbatches=m)
        spanned.train_step(*shard_batch((x, y), rank, world), nn.functional.mse_loss)
        for name, p in spanned.module.named_parameters():
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
            torch.testing.assert_close(
                _full(p.grad), want[name], rtol=1e-6, atol=1e-7, msg=lambda s: f"bf16, {m} mb: {name}: {s}"
            )
        nn.functional.mse_loss(whole(x), y).backward()
        _grads(spanned, whole, f"bf16, {m} micro-batches, against float32", rtol=5e-2, atol=5e-3)


def _planned(rank: int, world: int) -> None:
    """``span(model, plan)`` runs a plan's sharding (``Plan.shard``): a one-stage plan, one sharded replica
    per rank."""
    import dataclasses

    x, y = _data(18)
    model = _mlp()
    reference = copy.deepcopy(model)
    plan = dataclasses.replace(torchspan.plan(copy.deepcopy(model), x[:4], devices="cpu"), shard=True)
    spanned = torchspan.span(model, plan)
    assert spanned.mode == "sharded" and isinstance(model[0].weight, DTensor)
    got = spanned.train_step(*shard_batch((x, y), rank, world), nn.MSELoss())
    want = nn.MSELoss()(reference(x), y)
    want.backward()
    torch.testing.assert_close(got, want.detach(), **LOSS_TOL)
    _grads(spanned, reference, f"planned ({plan.microbatches} micro-batches)")


CASES = (
    _losses,
    _calibrations,
    _microbatches,
    _recompute,
    _join,
    _clip,
    _state,
    _memory,
    _tied_llama,
    _bf16,
    _planned,
)


def _worker(rank: int, world: int, port: int, out: str, names: tuple[str, ...]) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    torchspan.init_distributed(timeout=60)
    for case in CASES:
        if case.__name__ not in names:
            continue
        try:
            case(rank, world)
            verdict = "ok"
        except BaseException:
            verdict = "FAILED " + traceback.format_exc()
        Path(out, f"{case.__name__}.rank{rank}.txt").write_text(verdict)
    _leave()


def _verdicts(folder: Path, name: str, world: int) -> None:
    for rank in range(world):
        path = folder / f"{name}.rank{rank}.txt"
        assert path.exists(), (
            f"rank {rank} wrote no verdict for {name} (an earlier case left the ranks out of step?)"
        )
        text = path.read_text()
        assert text == "ok", f"rank {rank}:\n{text}"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sharded2")
    _spawn(_worker, 2, free_port(), str(out), tuple(c.__name__ for c in CASES), deadline=480.0)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", [c.__name__ for c in CASES])
def test_two_sharded_ranks_match_one_device(two_ranks: Path, name: str) -> None:
    _verdicts(two_ranks, name, 2)


@pytest.mark.slow
def test_four_sharded_ranks_uneven_and_empty_shards(tmp_path: Path) -> None:
    """7 rows over 4 ranks are 2 + 2 + 2 + 1, 3 rows leave rank 3 empty; memory ~1/4; Adam steps; join."""
    _spawn(_worker, 4, free_port(), str(tmp_path), ("_losses", "_memory", "_join"), deadline=300.0)
    for name in ("_losses", "_memory", "_join"):
        _verdicts(tmp_path, name, 4)


# ---------------------------------------------------------------------------------------------- in one
# process
@pytest.mark.parametrize(
    "options, words",
    [
        (dict(shard=True, precision="fp16"), "precision='fp16' is not supported with shard=True"),
        (dict(offload="cpu"), "offload='cpu' needs shard=True"),
        (dict(shard=True, offload="disk"), "offload='disk' is not one of None, 'cpu'"),
        (
            dict(shard=True, reshard_after_forward="yes"),
            "reshard_after_forward='yes' must be True .ZeRO-3. or False",
        ),
        (dict(shard="yes"), "shard='yes' must be True or False"),
        (
            dict(shard=True, devices=["cpu", "cpu"], balance=[2, 1]),
            "shard=True with 2 pipeline stages in one process",
        ),
    ],
)
def test_sharding_options_are_refused_before_any_work(options: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        torchspan.span(_mlp(), **options)
    assert not dist.is_initialized()  # refused before a process group is opened or anything is sharded


@pytest.mark.skipif(
    torch.accelerator.is_available(),
    reason="an accelerator is present: offload runs (test_offload_on_one_gpu_matches_one_device)",
)
def test_offload_is_refused_without_an_accelerator() -> None:
    from torchspan.runtime.ranks import DataParallelReplica

    words = r"offload='cpu' needs an accelerator \(a CUDA GPU\), and this machine has none"
    with pytest.raises(ValueError, match=words):
        torchspan.span(_mlp(), shard=True, offload="cpu")
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=words):
        DataParallelReplica(_mlp(), shard=True, offload="cpu")


def test_one_plain_process_shards_over_a_world_of_one() -> None:
    """``span(model, shard=True)`` in a plain process opens a world of one (the offload-on-one-GPU case)."""
    x, y = _data(16)
    model = _mlp()
    reference = copy.deepcopy(model)
    try:
        spanned = torchspan.span(model, shard=True)
        assert spanned.mode == "sharded" and dist.get_world_size() == 1
        opt, ref_opt = (
            torch.optim.Adam(spanned.parameters(), lr=0.1),
            torch.optim.Adam(reference.parameters(), lr=0.1),
        )
        for rows in (7, 5):
            got = spanned.train_step(
                x[:rows], PADDED[:rows], nn.CrossEntropyLoss(weight=CLASS_WEIGHTS, ignore_index=-1)
            )
            want = nn.CrossEntropyLoss(weight=CLASS_WEIGHTS, ignore_index=-1)(
                reference(x[:rows]), PADDED[:rows]
            )
            want.backward()
            torch.testing.assert_close(got, want.detach(), **LOSS_TOL)
            _grads(spanned, reference, f"world of one, {rows} rows")
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        assert list(spanned.state_dict()) == list(reference.state_dict())
        _weights(spanned, reference, "world of one, after Adam")
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="CPUOffloadPolicy computes on an accelerator (each unit's CPU shard is copied to the GPU for its "
    "forward and "
    "backward); this machine has none, and its refusal is tested by "
    "test_offload_is_refused_without_an_accelerator",
)
def test_offload_on_one_gpu_matches_one_device() -> None:
    """One GPU, parameters, gradients and Adam state in CPU memory, the optimizer step on the CPU: one
    device's weights."""
    model = _mlp(torch.float32)
    reference = copy.deepcopy(model).cuda()
    x, y = _data(17, torch.float32)
    try:
        spanned = torchspan.span(model, shard=True, offload="cpu")
        assert spanned.mode == "sharded" and spanned.offload == "cpu"
        assert all(p.to_local().device.type == "cpu" for p in spanned.parameters())
        opt, ref_opt = (
            torch.optim.Adam(spanned.parameters(), lr=0.1),
            torch.optim.Adam(reference.parameters(), lr=0.1),
        )
        for _ in range(2):
            spanned.train_step(x, y, nn.MSELoss())
            nn.MSELoss()(reference(x.cuda()), y.cuda()).backward()
            assert all(p.grad.to_local().device.type == "cpu" for p in spanned.parameters())
            ref = dict(reference.named_parameters())
            for name, p in spanned.module.named_parameters():
                torch.testing.assert_close(_full(p.grad), ref[name].grad.cpu(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(
                spanned.clip_grad_norm_(0.5),
                torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5).cpu(),
                rtol=1e-5,
                atol=1e-6,
            )
            opt.step()  # on the CPU: the state lives there
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        assert all(
            v.to_local().device.type == "cpu"
            for s in opt.state.values()
            for v in s.values()
            if isinstance(v, DTensor)
        )
        full = spanned.state_dict()
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(full[key].cpu(), value.cpu(), rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- a failing
# rank
FAILING = """
import os, signal
import torch
from torch import nn
import torchspan
torchspan.init_distributed(timeout=120)
rank = torch.distributed.get_rank()
torch.manual_seed(0)
spanned = torchspan.span(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), shard=True)
x, y = torch.randn(4, 4), torch.randn(4, 2)
spanned.train_step(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2], nn.MSELoss())
if rank == 1:
    if os.environ.get("HOW") == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError("rank one fails on purpose")
spanned.train_step(x[:2], y[:2], nn.MSELoss())  # rank 0 waits in an all-gather for rank 1, which never comes
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "how, shown", [("raise", "ValueError: rank one fails on purpose"), ("kill", "SIGKILL")]
)
def test_a_failed_sharded_rank_ends_the_job(how: str, shown: str, tmp_path: Path) -> None:
    """As for data parallel (tests/test_launch.py): the launcher ends every rank and names the one that
    failed."""
    import subprocess
    import sys
    import time

    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", HOW=how)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "torchspan", "launch", "--nproc-per-node", "2", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - start
    assert done.returncode == 1, done.stderr[-3000:]
    assert took < 60, f"the job took {took:.0f} s to end after a rank failed"
    report = done.stderr[done.stderr.index("torchspan launch: rank 1") :]
    assert shown in report, report[-3000:]
