"""Pipeline x sharded on 4 gloo ranks: 2 stages x 2 replicas, each stage sharded by FSDP2 over its replicas
(issue 20, item 3).

Mesh: rank = replica * 2 + stage, so ranks 0, 2 hold stage 0 and ranks 1, 3 stage 1; the ranks of one
replica pass the same shard (uneven: 5 rows = 3 + 2, 7 rows = 4 + 3). Every rank compares the full
gradient (``.grad.full_tensor()`` of its stage's sharded parameters, ``.grad`` of the replicated ones)
with one device on the whole global batch in float64: stage functions (an MLP, an fx model whose tied
embedding/head spans the stages) and the model's own forward (a tied Llama on its own loss), 1F1B and
GPipe with 2-3 micro-batches, ZeRO-2, recompute, an opaque loss calibrated on one replica only,
``clip_grad_norm_``, Adam steps, full-tensor state dicts, each rank holding half of its stage's shardable
parameters, one reduce-scatter per unit per step, bf16 equal to the unsharded hybrid's. One job runs
every case (each rank writes a verdict per case; one test per case).
"""

from __future__ import annotations

import copy
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_ranks_pipeline import TiedLM, _leave, _spawn
from torch import nn
from torch.distributed.tensor import DTensor

import torchspan
from torchspan.runtime.ranks import free_port, shard_batch

TOL = dict(rtol=1e-10, atol=1e-12)
LOSS_TOL = dict(rtol=1e-6, atol=1e-7)  # the returned loss is float32
OWN_LOSS_TOL = dict(rtol=1e-5, atol=1e-7)  # transformers compute their own loss in float32
WORLD = 4


def _seq() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 6), nn.Linear(6, 4)).double()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _check(
    spanned: torchspan.Spanned,
    reference: nn.Module,
    label: str,
    sharded: set[str] | None = None,
    **tol: float,
) -> list[str]:
    """Every parameter this rank holds against the reference's gradient; ``sharded``: the names that must be
    DTensors. Returns the names held."""
    ref = dict(reference.named_parameters())
    held = []
    for name, p in spanned.module.named_parameters():
        if p.device.type == "meta":
            assert not p.requires_grad, f"{label}: {name} is another stage's but trainable"
            continue
        held.append(name)
        if sharded is not None:
            assert isinstance(p, DTensor) == (name in sharded), f"{label}: {name} is {type(p).__name__}"
        assert p.grad is not None, f"{label}: {name} has no gradient"
        torch.testing.assert_close(
            _full(p.grad), ref[name].grad, **(tol or TOL), msg=lambda m: f"{label}: {name}: {m}"
        )
    return held


def _data(seed: int, rows: int = 5):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 5, generator=g, dtype=torch.float64), torch.randn(
        rows, 4, generator=g, dtype=torch.float64
    )


LABELS = torch.tensor([0, 3, 3, 1, 2, 3, 0])
CLASS_WEIGHTS = torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=torch.float64)
MLP_SHARDED = {"0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias"}


# ------------------------------------------------------------------------------------ stage functions
def _mlp_losses(rank: int, replica: int) -> None:
    """Uneven shards, losses read by torchspan, both schedules, ZeRO-2, recompute, accumulation over two
    steps."""
    x, y = _data(7, 7)
    cases = [
        (nn.MSELoss(), y[:5], 2, "gpipe", {}),
        (nn.MSELoss(reduction="sum"), y[:5], 2, "1f1b", {}),
        (nn.CrossEntropyLoss(weight=CLASS_WEIGHTS, ignore_index=1), LABELS[:5], 2, "1f1b", {}),
        (nn.MSELoss(), y, 3, "1f1b", {}),  # 7 rows: 4 + 3, three micro-batches each
        (nn.MSELoss(), y, 3, "1f1b", dict(reshard_after_forward=False)),
        (nn.CrossEntropyLoss(), LABELS, 3, "gpipe", dict(recompute="always")),
    ]
    for loss_fn, target, m, schedule, options in cases:
        label = f"{type(loss_fn).__name__}, {m} micro-batches, {schedule}, {options}"
        rows = len(target)
        model = _seq()
        reference = copy.deepcopy(model)
        spanned = torchspan.span(
            model, balance=[2, 2], microbatches=m, schedule=schedule, shard=True, **options
        )
        assert spanned.mode == "sequential", label
        for part in (slice(0, rows), slice(0, rows - 1)):  # a second step accumulates, as on one device
            got = spanned.train_step(*shard_batch((x[part], target[part]), replica, 2), loss_fn)
            want = loss_fn(reference(x[part]), target[part])
            want.backward()
            torch.testing.assert_close(
                got.double(), want.detach(), **LOSS_TOL, msg=lambda s: f"{label}: loss: {s}"
            )
            _check(spanned, reference, f"{label}, rows {part}", MLP_SHARDED)


def _mlp_training(rank: int, replica: int) -> None:
    """Adam steps with clipping on shards 4 + 3, 3 + 3, 3 + 2: one device's weights; one reduce-scatter per
    unit per step; full-tensor state dicts; each rank holds half of its stage."""
    x, y = _data(8, 7)
    model = _seq()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, balance=[2, 2], microbatches=2, schedule="1f1b", shard=True)
    opt, ref_opt = (
        torch.optim.Adam(spanned.parameters(), lr=0.05),
        torch.optim.Adam(reference.parameters(), lr=0.05),
    )
    counts = []
    real = dist.reduce_scatter_single
    dist.reduce_scatter_single = lambda *a, **k: counts.append(1) or real(*a, **k)  # type: ignore[assignment]
    try:
        for rows in (7, 6, 5):
            opt.zero_grad()
            ref_opt.zero_grad()
            counts.clear()
            spanned.train_step(*shard_batch((x[:rows], y[:rows]), replica, 2), nn.MSELoss())
            assert len(counts) == (1 if rank % 2 == 0 else 2), (
                f"{len(counts)} reduce-scatters for this stage's units"
            )
            nn.MSELoss()(reference(x[:rows]), y[:rows]).backward()
            got = spanned.clip_grad_norm_(0.3)
            want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.3)
            torch.testing.assert_close(got, want, **TOL)
            _check(spanned, reference, f"clipped, {rows} rows", MLP_SHARDED)
            opt.step()
            ref_opt.step()
    finally:
        dist.reduce_scatter_single = real  # type: ignore[assignment]
    ref = dict(reference.named_parameters())
    for name, p in spanned.module.named_parameters():
        if not p.is_meta:
            torch.testing.assert_close(
                _full(p.detach()), ref[name].detach(), rtol=1e-9, atol=1e-11, msg=lambda s: f"{name}: {s}"
            )
    with torch.no_grad():  # a forward: a collective of every rank (in training it refuses: train_step)
        torch.testing.assert_close(spanned(x), reference(x).detach(), **TOL)
    assert spanned.memory(opt)[rank % 2]["params"] > 0
    assert "each stage sharded over its replicas" in spanned.mode_reason
    _memory(spanned, reference, rank)
    _state(spanned, reference, rank)


def _memory(spanned: torchspan.Spanned, reference: nn.Module, rank: int) -> None:
    """Each rank holds half of its stage's parameters and gradients (local shards); the replicas together all
    of them."""
    stage = {name for name, p in spanned.module.named_parameters() if not p.is_meta}
    total = sum(p.numel() for name, p in reference.named_parameters() if name in stage)
    mine = sum(_local(p).numel() for name, p in spanned.module.named_parameters() if name in stage)
    grads = sum(_local(p.grad).numel() for name, p in spanned.module.named_parameters() if name in stage)
    together = [0] * WORLD
    dist.all_gather_object(together, mine)
    assert together[rank % 2] + together[rank % 2 + 2] == total, (together, total)
    assert mine == grads and mine <= total / 2 * 1.05, (
        f"rank {rank} holds {mine} of its stage's {total} values"
    )


def _state(spanned: torchspan.Spanned, reference: nn.Module, rank: int) -> None:
    full = spanned.state_dict()
    assert list(full) == list(reference.state_dict())
    for key, value in reference.state_dict().items():
        if not full[key].is_meta:
            assert type(full[key]) is torch.Tensor, f"{key} is {type(full[key]).__name__}"
            torch.testing.assert_close(full[key], value, rtol=1e-9, atol=1e-11, msg=lambda s: f"{key}: {s}")
    other = _seq()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-2.0)
    spanned.load_state_dict(other.state_dict())
    for key, value in spanned.state_dict().items():
        if not value.is_meta:
            torch.testing.assert_close(
                value, other.state_dict()[key], rtol=0, atol=0, msg=lambda s: f"loaded {key}: {s}"
            )


def _calibration(rank: int, replica: int) -> None:
    """An opaque loss calibrated per shard structure: on the second step only replica 1's is new (3 + 2 rows,
    then 3 + 3), and its dry forward gathers the stage's shards, so replica 0 runs it too (each deciding alone
    would hang)."""
    x, y = _data(9, 7)
    model = _seq()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, balance=[2, 2], microbatches=2, schedule="1f1b", shard=True)
    mean = lambda out, t: ((out - t) ** 2).mean()  # noqa: E731
    for step, rows in enumerate((5, 6, 7)):
        spanned.module.zero_grad()
        reference.zero_grad()
        got = spanned.train_step(*shard_batch((x[:rows], y[:rows]), replica, 2), mean)
        want = mean(reference(x[:rows]), y[:rows])
        want.backward()
        torch.testing.assert_close(got.double(), want.detach(), **LOSS_TOL)
        _check(spanned, reference, f"calibrated lambda, step {step} ({rows} rows)", MLP_SHARDED)


def _clip_norms(rank: int, replica: int) -> None:
    x, _ = _data(10, 7)
    model = _seq()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, balance=[2, 2], microbatches=3, schedule="1f1b", shard=True)
    loss_fn = nn.CrossEntropyLoss(weight=CLASS_WEIGHTS, ignore_index=1)
    spanned.train_step(*shard_batch((x, LABELS), replica, 2), loss_fn)
    loss_fn(reference(x), LABELS).backward()
    for norm_type, max_norm in ((2.0, 0.05), (float("inf"), 0.01), (1.0, 0.02), (3.0, 1e3)):
        got = spanned.clip_grad_norm_(max_norm, norm_type)
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
        assert not isinstance(got, DTensor)
        torch.testing.assert_close(got, want, **TOL, msg=lambda s: f"norm_type={norm_type}: {s}")
        _check(spanned, reference, f"clipped, norm_type={norm_type}", MLP_SHARDED)


def _tied_fx(rank: int, replica: int) -> None:
    """An fx model whose tied embedding/head weight spans the stages: the tie stays one replicated parameter
    (all-reduced in its group of all four ranks), the layer between is sharded."""
    g = torch.Generator().manual_seed(11)
    ids, tokens = torch.randint(0, 11, (5, 3), generator=g), torch.randint(0, 11, (5, 3), generator=g)
    model = TiedLM()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, balance=[2, 1], microbatches=2, schedule="1f1b", shard=True)
    assert spanned.mode == "fx"
    loss_fn = nn.CrossEntropyLoss()
    got = spanned.train_step(
        *shard_batch((ids, tokens), replica, 2),
        lambda out, t: loss_fn(out, t.flatten()),
        loss_reduction="mean",
    )
    want = loss_fn(reference(ids), tokens.flatten())
    want.backward()
    torch.testing.assert_close(got.double(), want.detach(), **LOSS_TOL)
    _check(spanned, reference, "tied fx", {"mid.weight", "mid.bias"})
    torch.optim.SGD(spanned.parameters(), lr=0.5).step()
    copies = [torch.zeros(11, 6, dtype=torch.float64) for _ in range(WORLD)]
    dist.all_gather(copies, model.embed.weight.detach())
    assert all(torch.equal(c, copies[0]) for c in copies), "the tied weight's copies drifted apart"


def _bf16(rank: int, replica: int) -> None:
    """bf16 autocasts each stage as the hybrid does: the sharded pipeline's gradients equal the unsharded
    hybrid's."""
    x, y = _data(12, 7)
    grads = []
    for shard in (False, True):
        model = _seq().float()
        spanned = torchspan.span(
            model, balance=[2, 2], microbatches=2, schedule="1f1b", precision="bf16", shard=shard
        )
        spanned.train_step(*shard_batch((x.float(), y.float()), replica, 2), nn.MSELoss())
        grads.append({n: _full(p.grad) for n, p in spanned.module.named_parameters() if not p.is_meta})
    for name, g in grads[0].items():
        assert g.dtype == torch.float32, name
        torch.testing.assert_close(grads[1][name], g, rtol=1e-6, atol=1e-7, msg=lambda s: f"bf16 {name}: {s}")


def _planned(rank: int, replica: int) -> None:
    """``span(model, plan)`` runs a plan's pipeline x sharded (``Plan.shard`` with 2 stages,
    ``data_parallel=2``)."""
    import dataclasses

    x, y = _data(13, 7)
    model = _seq()
    reference = copy.deepcopy(model)
    plan = torchspan.plan(
        copy.deepcopy(model),
        x[:4],
        devices="h100-80gb*2",
        memory={"cuda:0": "4KB", "cuda:1": "4KB"},
        microbatches=2,
        schedule="1f1b",
    )  # made sharded below: FSDP2 stages run whole backwards, as 1F1B
    assert [s.layers for s in plan.stages] == [["0", "1"], ["2", "3"]], plan.stages
    # a cluster plan's own rank table: stage 0 on ranks 0, 1 and stage 1 on ranks 2, 3 (replica = rank % 2)
    plan = dataclasses.replace(
        plan, shard=True, data_parallel=2, stage_ranks=[[0, 1], [2, 3]], devices_per_node=4
    )
    replica = rank % 2
    spanned = torchspan.span(model, plan)
    got = spanned.train_step(*shard_batch((x, y), replica, 2), nn.MSELoss())
    want = nn.MSELoss()(reference(x), y)
    want.backward()
    torch.testing.assert_close(got.double(), want.detach(), **LOSS_TOL)
    _check(spanned, reference, f"planned ({plan.schedule}, {plan.microbatches} micro-batches)", MLP_SHARDED)


def _refused(rank: int, replica: int) -> None:
    """4 stages on 4 ranks: no replicas to shard a stage over; refused on every rank before anything is
    placed."""
    with pytest.raises(ValueError, match=r"shard=True with pp\(4\) x dp\(1\)"):
        torchspan.span(_seq(), balance=[1, 1, 1, 1], shard=True)


# ---------------------------------------------------------------------------------------------- the model's
# own forward
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


def _tied_llama(rank: int, replica: int) -> None:
    """A tied Llama on its own loss (labels in the batch, padding), 1F1B with 2 micro-batches on 3 + 2 rows,
    AdamW steps: each stage's blocks sharded, the tied embedding/head one replicated parameter; state dict
    full tensors."""
    model = _llama()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, devices=["cpu", "cpu"], microbatches=2, schedule="1f1b", shard=True)
    assert spanned.mode == "own-forward"
    g = torch.Generator().manual_seed(14)
    ids = torch.randint(0, 64, (5, 9), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    labels[3, 5:] = -100  # padding in both replicas' shards (3 + 2 rows)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    opt, ref_opt = (
        torch.optim.AdamW(spanned.parameters(), lr=0.01),
        torch.optim.AdamW(reference.parameters(), lr=0.01),
    )
    for step, rows in enumerate((5, 4)):
        part = {k: v[:rows] for k, v in batch.items()}
        got = spanned.train_step(shard_batch(part, replica, 2))
        want = reference(**part).loss
        want.backward()
        torch.testing.assert_close(got.double(), want.detach().double(), **OWN_LOSS_TOL)
        held = _check(spanned, reference, f"tied Llama, step {step}", **OWN_LOSS_TOL)
        blocks = {n for n in held if n.startswith(("model.layers.", "model.norm."))}
        assert all(
            isinstance(p, DTensor) == (n in blocks) for n, p in spanned.module.named_parameters() if n in held
        ), held
        assert "model.embed_tokens.weight" in held and len(blocks) == 9 + (1 if rank % 2 else 0)
        torch.testing.assert_close(
            spanned.clip_grad_norm_(0.5),
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5),
            rtol=1e-9,
            atol=1e-12,
        )
        # built before the first call placed and sharded the stage: it steps the sharded parameters
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert sum(isinstance(p, DTensor) for p in opt.param_groups[0]["params"]) == len(blocks)
    full = spanned.state_dict()
    for key, value in reference.state_dict().items():
        if key in full and not full[key].is_meta:
            torch.testing.assert_close(full[key], value, rtol=1e-6, atol=1e-8, msg=lambda s: f"{key}: {s}")
    embed = spanned.module.model.embed_tokens.weight
    sharded = sum(p.numel() for n, p in reference.named_parameters() if n in blocks)
    mine = sum(_local(p).numel() for n, p in spanned.module.named_parameters() if n in blocks)
    assert mine <= sharded / 2 * 1.05, f"rank {rank} holds {mine} of its stage's {sharded} sharded values"
    copies = [torch.empty_like(embed) for _ in range(WORLD)]
    dist.all_gather(copies, embed.detach())
    assert all(torch.equal(c, copies[0]) for c in copies), "the tied embedding's copies drifted apart"


def _token_ce(out, labels):  # type: ignore[no-untyped-def]
    logits = out.logits if hasattr(out, "logits") else out
    return (
        nn.functional.cross_entropy(
            logits.flatten(0, 1).double(), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        / (labels != -100).sum()
    )


def _llama_recompute(rank: int, replica: int) -> None:
    """The model's own forward with every block recomputed, ZeRO-2, GPipe, 7 rows in 4 + 3, a declared
    token-mean loss (verified on a dry forward wherever a shard's structure is new: every rank runs it)."""
    model = _llama()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(
        model,
        devices=["cpu", "cpu"],
        microbatches=3,
        schedule="gpipe",
        recompute="always",
        shard=True,
        reshard_after_forward=False,
    )
    g = torch.Generator().manual_seed(15)
    ids = torch.randint(0, 64, (7, 6), generator=g)
    labels = ids.clone()
    labels[1, 3:] = -100
    tokens = lambda t: (t != -100).sum()  # noqa: E731
    for rows in (7, 6):
        spanned.module.zero_grad()
        reference.zero_grad()
        got = spanned.train_step(
            shard_batch(ids[:rows], replica, 2),
            shard_batch(labels[:rows], replica, 2),
            _token_ce,
            loss_normalizer=tokens,
        )
        want = _token_ce(reference(ids[:rows]), labels[:rows])
        want.backward()
        torch.testing.assert_close(got.double(), want.detach(), **LOSS_TOL)
        _check(spanned, reference, f"Llama recomputed, ZeRO-2, {rows} rows")


CASES = (
    _mlp_losses,
    _mlp_training,
    _calibration,
    _clip_norms,
    _tied_fx,
    _bf16,
    _planned,
    _refused,
    _tied_llama,
    _llama_recompute,
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
            case(rank, rank // 2)
            verdict = "ok"
        except BaseException:
            verdict = "FAILED " + traceback.format_exc()
        Path(out, f"{case.__name__}.rank{rank}.txt").write_text(verdict)
    _leave()


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pipeline_sharded")
    _spawn(_worker, WORLD, free_port(), str(out), tuple(c.__name__ for c in CASES), deadline=600.0)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", [c.__name__ for c in CASES])
def test_two_stages_by_two_sharded_replicas_match_one_device(four_ranks: Path, name: str) -> None:
    for rank in range(WORLD):
        path = four_ranks / f"{name}.rank{rank}.txt"
        assert path.exists(), (
            f"rank {rank} wrote no verdict for {name} (an earlier case left the ranks out of step?)"
        )
        text = path.read_text()
        assert text == "ok", f"rank {rank}:\n{text}"


# ---------------------------------------------------------------------------------------------- in one
# process
@pytest.mark.parametrize(
    "options, words",
    [
        (
            dict(shard=True, devices=["cpu", "cpu"], balance=[2, 2]),
            r"shard=True with 2 pipeline stages in one process",
        ),
        (dict(shard=True, devices="cpu,cpu,cpu"), r"shard=True with 3 pipeline stages in one process"),
    ],
)
def test_pipeline_sharding_in_one_process_is_refused_naming_the_launch(options: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words) as caught:
        torchspan.span(_seq(), **options)
    assert "torchspan launch --nproc-per-node" in str(caught.value)
    assert not dist.is_initialized()  # refused before a process group is opened or anything is sharded
