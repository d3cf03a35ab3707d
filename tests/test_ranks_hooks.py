"""Pipelines across gloo ranks for models that run their own forward: transformers decoders with tied
embeddings, keyword inputs and ``ModelOutput``s, an encoder-decoder (T5), and user wrappers around
``ModuleList``s.

Each rank runs the model's forward with other stages' layers on ``meta`` (``runtime.ranks.hooked``).
Every spawned rank compares the gradients of the parameters it holds, by name, with one device on
the whole batch in float64 (uneven micro-batches, token-mean losses, two steps with a new sequence
length); the in-process tests pin the routing and taint rules the executor relies on.
"""

from __future__ import annotations

import copy
import os
import traceback
import types
from pathlib import Path

import pytest
import torch
from test_ranks_pipeline import TOL, _check, _spawn
from torch import nn
from torch.utils._pytree import tree_flatten

import torchspan
from torchspan.runtime.ranks import free_port, init_distributed
from torchspan.runtime.ranks.routes import GRAD, META, REAL, DivergedError, Reuse, Seen, Transfer, route_call
from torchspan.runtime.ranks.taint import MetaTaint

transformers = pytest.importorskip("transformers")

LOSS_TOL = dict(rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------- in process: routes and taint
def test_route_takes_each_meta_argument_from_the_latest_earlier_stage_holding_it() -> None:
    seen = [
        Seen("blocks.4", (GRAD, REAL, REAL), (None, None, None)),
        Seen("blocks.4", (GRAD, META, REAL), (None, None, None)),
        Seen("blocks.4", (META, META, REAL), (None, (3, 1), None)),
    ]
    route = route_call(9, "blocks.4", 2, seen)
    assert route.transfers == [Transfer(leaf=0, src=1, dst=2, grad=True)]
    assert route.reuses == [Reuse(leaf=1, call=3, at=1)]
    route.check(2, "blocks.4", (META, META, REAL))
    with pytest.raises(DivergedError, match="left the recorded path at layer call 9"):
        route.check(2, "blocks.4", (META, REAL, REAL))


def test_route_refuses_what_no_earlier_stage_computes_and_diverged_ranks() -> None:
    seen = [Seen("head", (META,), (None,)), Seen("head", (REAL,), (None,))]
    with pytest.raises(
        ValueError,
        match=r"layer 'head' \(stage 0\) reads tensor argument 0, which only later stage\(s\) \[1\]",
    ):
        route_call(0, "head", 0, seen)
    mixed = [Seen("head", (META,), (None,)), Seen("head", (META,), (None,))]
    with pytest.raises(ValueError, match="no single stage computes: the model's own code combined values"):
        route_call(3, "head", 1, mixed)
    with pytest.raises(DivergedError, match="diverged at layer call 4"):
        route_call(4, "head", 1, [Seen("head", (REAL,), (None,)), Seen("mid", (REAL,), (None,))])


def test_meta_taint_glue_rules() -> None:
    other = torch.ones(2, 3, device="meta")  # another stage's value
    here = torch.arange(6.0).reshape(2, 3)
    with MetaTaint(torch.device("cpu")):
        assert (here + other).is_meta and torch.cat([here, other]).is_meta  # mixed: another stage's
        positions = torch.arange(3, device=other.device)  # made from a shape: real here
        assert positions.device.type == "cpu" and positions.tolist() == [0, 1, 2]
        assert torch.zeros_like(other).device.type == "cpu" and other.new_ones(2).device.type == "cpu"
        moved = here.to(other.device, other.dtype)
        assert moved.device.type == "cpu" and torch.equal(moved, here)
        with pytest.raises(RuntimeError, match=r"in place \(add_\)"):
            here.add_(other)
        with pytest.raises(RuntimeError, match=r"in place \(__setitem__\)"):
            here[0] = other[0]
        with pytest.raises(RuntimeError, match="meta"):
            bool(other.sum() > 0)  # a value of another stage's tensor cannot steer this rank's forward
    assert torch.equal(here, torch.arange(6.0).reshape(2, 3))


def test_the_last_stage_runs_torchs_own_losses_without_the_taint_mode_and_keeps_it_for_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Torch's losses read only their arguments: with real outputs they skip ``MetaTaint`` (the same value,
    ~50 us less per micro-batch on the critical path); a user's callable keeps it (it may read another stage's
    parameter, ``model.device``), and a meta output is still refused."""
    import functools

    import torch.nn.functional as F

    from torchspan.runtime.ranks import ownloss

    entered: list[int] = []

    class Counted(MetaTaint):
        def __enter__(self) -> Counted:
            entered.append(1)
            return super().__enter__()

    monkeypatch.setattr(ownloss, "MetaTaint", Counted)
    cpu = torch.device("cpu")
    out, y, labels = torch.randn(4, 3, requires_grad=True), torch.randn(4, 3), torch.tensor([0, 2, -1, 1])
    other_stage = torch.ones(1, device="meta")  # a parameter another rank holds
    losses = [
        (nn.MSELoss(), y, False),
        (F.mse_loss, y, False),
        (functools.partial(F.cross_entropy, ignore_index=-1), labels, False),
        (nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5])), labels.clamp(min=0), False),
        (
            lambda o, t: F.mse_loss(o, t.to(other_stage.device)),
            y,
            True,
        ),  # reads another stage's device: this rank's
    ]
    for loss_fn, target, taint in losses:
        entered.clear()
        got = ownloss.stage_loss(out, target, loss_fn, 0.5, cpu, "32")
        want = 0.5 * (F.mse_loss(out, target) if taint else loss_fn(out, target))
        torch.testing.assert_close(got, want)
        assert len(entered) == int(taint), (loss_fn, entered)
    with pytest.raises(ValueError, match="does not compute"):
        ownloss.stage_loss(torch.ones(4, 3, device="meta"), y, nn.MSELoss(), 1.0, cpu, "32")


def test_meta_calls_run_a_layer_once_per_call_shape_and_replay_it() -> None:
    from torchspan.runtime.ranks.metacalls import MetaCalls

    calls, route = MetaCalls(), object()

    def call(fn, args, kwargs):  # noqa: ANN001 - as RankHookExecutor calls it: flattened meta arguments
        leaves, spec = tree_flatten((args, kwargs))
        return calls.run(route, layer, fn, leaves, spec)

    layer = nn.Linear(4, 3).to("meta")
    x = torch.empty(5, 4, device="meta")
    first = call(layer, (x,), {})
    again = call(layer, (torch.empty(5, 4, device="meta"),), {})
    assert calls.ran == 1 and first.shape == again.shape == (5, 3) and first is not again and again.is_meta
    call(layer, (torch.empty(2, 4, device="meta"),), {})  # another shape: runs
    layer.eval()
    call(layer, (x,), {})  # the training flag is part of the key
    assert calls.ran == 3

    passthrough = lambda h, scale=1.0: (h, h.float() * scale)  # noqa: E731 - returns its own argument
    y = torch.empty(2, 2, dtype=torch.bfloat16, device="meta")
    out = call(passthrough, (y,), {"scale": 2.0})
    out2 = call(passthrough, (y,), {"scale": 2.0})
    assert out2[0] is y and out2[1].dtype == torch.float32 and calls.ran == 4 and out[0] is y
    stateful = lambda h, cache: (h + 1, cache.seen.append(1))  # noqa: E731 - an object argument: never replayed
    cache = types.SimpleNamespace(seen=[])
    call(stateful, (y, cache), {})
    call(stateful, (y, cache), {})
    assert cache.seen == [1, 1] and calls.ran == 6


def test_a_layer_growing_a_container_it_was_given_is_refused() -> None:
    from torchspan.runtime.ranks.taint import check_unchanged, container_sizes

    given = ([torch.ones(1)], {"k": {"a": 1}})
    sizes = container_sizes(given)
    check_unchanged(sizes, "blocks.0")
    given[1]["k"]["b"] = 2
    with pytest.raises(ValueError, match=r"layer 'blocks.0' changed a dict it was given \(length 1 -> 2\)"):
        check_unchanged(sizes, "blocks.0")


# ---------------------------------------------------------------------- models
def _llama(tied: bool = True) -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tied,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double()


def _gpt2() -> nn.Module:
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
    return transformers.GPT2LMHeadModel(cfg).double()


class Wrapped(nn.Module):
    """What users write: blocks in a ModuleList, a parameter of the model's own read by the glue, a keyword
    input."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.embed = nn.Embedding(30, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(4))
        self.gain = nn.Parameter(torch.tensor(1.5))
        self.head = nn.Linear(8, 30, bias=False)
        self.head.weight = self.embed.weight
        self.double()

    def forward(self, ids: torch.Tensor, *, mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        h = self.embed(ids) * self.gain
        for block in self.blocks:
            h = block(h) + h  # the residual in the model's own code reads what crossed to this rank
        if mask is not None:
            h = h * mask.unsqueeze(-1)
        return {"logits": self.head(h)}


def _token_ce(out, labels):
    logits = out["logits"] if isinstance(out, dict) else out.logits
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels != -100).sum()


def _join(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    init_distributed(timeout=30)


def _leave() -> None:
    """Leave the job together: a rank exiting with its gloo groups alive can abort in their threads'
    teardown."""
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _batch(seed: int, rows: int, length: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    labels = torch.randint(0, vocab, (rows, length), generator=g)
    labels[0, :3] = -100
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[1, -2:] = 0  # padding: the model's glue builds a padded causal mask from it
    return ids, labels, mask


def _train_and_compare(
    make, label: str, rank: int, world: int, vocab: int, with_mask: bool, **span_args
) -> None:
    model = make()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, **span_args)
    for step, length in enumerate((7, 5)):  # the second step records new routes for a new sequence length
        ids, labels, mask = _batch(10 + step, 5, length, vocab)  # 5 rows in 3 micro-batches: 2 + 2 + 1
        inputs = {"input_ids": ids, "attention_mask": mask} if with_mask else {"ids": ids}
        for p in [*spanned.module.parameters(), *reference.parameters()]:
            p.grad = None
        loss = spanned.train_step(inputs, labels, _token_ce, loss_normalizer=_tokens)
        expected = _token_ce(reference(**inputs), labels)
        expected.backward()
        torch.testing.assert_close(loss.double(), expected.detach(), **LOSS_TOL)
        held = _check(spanned, reference, f"{label} step {step}", rank)
        assert held > 0, f"{label}: rank {rank} holds no parameters"
        assert spanned.memory()[rank]["activations"] > 0, f"{label}: rank {rank}'s stage saved no activations"
    metered = spanned.memory()[rank]["activations"]
    meter = spanned._meter
    saving, meter.saving = meter.saving, None  # the same shapes again: no saved-tensor hooks this step
    try:
        spanned.train_step(inputs, labels, _token_ce, loss_normalizer=_tokens)
    finally:
        meter.saving = saving
    assert spanned.memory()[rank]["activations"] == metered  # the metered step's peak still reported
    with torch.no_grad():  # a forward: the last stage's outputs, on every rank
        ids, _, mask = _batch(30, 3, 6, vocab)
        inputs = {"input_ids": ids, "attention_mask": mask} if with_mask else {"ids": ids}
        out = spanned(**inputs)
        want = reference(**inputs)
        got = out["logits"] if isinstance(out, dict) else out.logits
        torch.testing.assert_close(got, want["logits"] if isinstance(want, dict) else want.logits, **TOL)


def _t5_across_ranks(rank: int) -> None:
    """Encoder-decoder: the encoder's output feeds every decoder block on the other rank (cross-attention),
    and the shared embedding is tied across the ranks."""
    cfg = transformers.T5Config(
        vocab_size=40,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        dropout_rate=0.0,
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(3)
    model = transformers.T5ForConditionalGeneration(cfg).double()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(4)
    ids, dec, labels = (torch.randint(1, 40, shape, generator=g) for shape in ((5, 7), (5, 4), (5, 4)))
    labels[0, 2:] = -100
    spanned = torchspan.span(model, devices=["cpu", "cpu"], microbatches=2, schedule="1f1b")
    inputs = {"input_ids": ids, "decoder_input_ids": dec}
    loss = spanned.train_step(inputs, labels, _token_ce, loss_normalizer=_tokens)
    expected = _token_ce(reference(**inputs), labels)
    expected.backward()
    torch.testing.assert_close(loss.double(), expected.detach(), **LOSS_TOL)
    assert _check(spanned, reference, "t5", rank) > 0


def _hf_worker(rank: int, world: int, port: int, plan: torchspan.Plan) -> None:
    _join(rank, world, port)
    for schedule in ("gpipe", "1f1b"):
        _train_and_compare(
            _llama,
            f"llama tied {schedule}",
            rank,
            world,
            40,
            True,
            devices=["cpu", "cpu"],
            microbatches=3,
            schedule=schedule,
        )
    _train_and_compare(
        _gpt2,
        "gpt2 balance [5, 3] checkpointed",
        rank,
        world,
        40,
        True,
        balance=[5, 3],
        microbatches=3,
        schedule="1f1b",
        recompute="except_last",
    )
    _train_and_compare(
        Wrapped, "wrapper", rank, world, 30, False, balance=[3, 3], microbatches=3, schedule="1f1b"
    )
    _t5_across_ranks(rank)
    # A plan made for a described cluster (two H100s) runs on whatever device each launched rank has.
    assert [st.device for st in plan.stages] == ["cuda:0", "cuda:1"]
    _train_and_compare(_llama, "llama from a 2-GPU plan", rank, world, 40, True, plan=plan)
    _leave()


def _bf16_worker(rank: int, world: int, port: int) -> None:
    """bf16 autocast across ranks gives what the same autocast gives in one process (threads over two CPU
    stages)."""
    torch.set_num_threads(1)
    make = lambda: _llama().float()  # noqa: E731
    ids, labels, mask = _batch(40, 5, 7, 40)
    inputs = {"input_ids": ids, "attention_mask": mask}
    options = dict(devices=["cpu", "cpu"], microbatches=3, schedule="1f1b", precision="bf16")
    local = torchspan.span(make(), **options)  # before joining the job: this process's own pipeline
    assert local.mode == "own-forward"
    want = local.train_step(inputs, labels, _token_ce, loss_normalizer=_tokens)
    _join(rank, world, port)
    spanned = torchspan.span(make(), **options)
    assert spanned.mode == "own-forward"
    got = spanned.train_step(inputs, labels, _token_ce, loss_normalizer=_tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    ref = dict(local.module.named_parameters())
    for name, p in spanned.module.named_parameters():
        if not p.is_meta:
            torch.testing.assert_close(
                p.grad, ref[name].grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}: {name}: {m}"
            )
    _leave()


@pytest.mark.slow
def test_bf16_across_ranks_matches_bf16_in_one_process() -> None:
    _spawn(_bf16_worker, 2, free_port(), deadline=120.0)


@pytest.mark.slow
def test_transformers_decoders_and_wrappers_across_two_ranks_match_one_device() -> None:
    ids, _, _ = _batch(1, 6, 7, 40)
    plan = torchspan.plan(
        _llama(), (ids,), devices="h100-80gb*2", memory={"cuda:0": "250KB", "cuda:1": "250KB"}, microbatches=3
    )
    _spawn(_hf_worker, 2, free_port(), plan, deadline=240.0)


def _hybrid_worker(rank: int, world: int, port: int) -> None:
    _join(rank, world, port)
    model = _llama()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, devices=["cpu", "cpu"], microbatches=2, schedule="1f1b")
    ids, labels, mask = _batch(5, 6, 6, 40)
    replica = rank // 2  # rank = replica * stages + stage
    rows = slice(0, 4) if replica == 0 else slice(4, 6)  # uneven shards: 4 + 2 rows
    inputs = {"input_ids": ids[rows], "attention_mask": mask[rows]}
    loss = spanned.train_step(inputs, labels[rows], _token_ce, loss_normalizer=_tokens)
    expected = _token_ce(reference(ids, attention_mask=mask), labels)
    expected.backward()
    torch.testing.assert_close(loss.double(), expected.detach(), **LOSS_TOL)
    _check(spanned, reference, "llama 2x2", rank)
    opt = torch.optim.SGD(spanned.parameters(), lr=0.1)
    opt.step()
    embed = spanned.module.model.embed_tokens.weight  # tied: held by both stages, identical on all four ranks
    assert embed.device.type != "meta"
    copies = [torch.empty_like(embed) for _ in range(world)]
    torch.distributed.all_gather(copies, embed.detach())
    for other in copies:
        torch.testing.assert_close(other, copies[0], rtol=0, atol=0)
    _leave()


@pytest.mark.slow
def test_two_by_two_hybrid_of_a_tied_transformers_decoder_matches_one_device() -> None:
    _spawn(_hybrid_worker, 4, free_port(), deadline=240.0)


def _inplace_worker(rank: int, world: int, port: int, out: str) -> None:
    _join(rank, world, port)

    class Doubler(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.mul_(2)  # writes into its input, which the previous rank computed and still holds

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), Doubler(), nn.Linear(4, 4)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x

    spanned = torchspan.span(Net(), balance=[2, 2], microbatches=2)
    try:
        with torch.no_grad():
            spanned(torch.randn(4, 4))
    except BaseException as exc:
        Path(out, f"rank{rank}.txt").write_text("".join(traceback.format_exception(exc)))
        return
    Path(out, f"rank{rank}.txt").write_text("no error")


@pytest.mark.slow
def test_a_layer_writing_into_an_input_other_ranks_hold_is_refused(tmp_path: Path) -> None:
    took = _spawn(_inplace_worker, 2, free_port(), str(tmp_path), deadline=90.0)
    owner = (tmp_path / "rank1.txt").read_text()
    assert "modifies its tensor argument 0 in place" in owner, owner
    assert (tmp_path / "rank0.txt").read_text() != "no error"  # the other rank stops too (its peer left)
    assert took < 60


VERIFY_MODELS = """
import torch, transformers

def llama():
    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                                   use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)
"""


@pytest.mark.slow
def test_verify_runs_a_tied_transformers_decoder_as_a_rank_pipeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchspan.cli import main

    (tmp_path / "hf_models.py").write_text(VERIFY_MODELS)
    code = main(
        [
            "verify",
            f"{tmp_path / 'hf_models.py'}:llama",
            "--input",
            "input_ids=7,6:int64",
            "--vocab",
            "40",
            "--devices",
            "cpu,cpu",
            "--microbatches",
            "3",
            "--strategies",
            "single,rank-pipeline",
            "--nproc",
            "2",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "rank-pipeline (2 processes): PASS" in out and "model.layers.3.mlp.down_proj.weight" in out


def _other_batch_worker(rank: int, world: int, port: int, out: str) -> None:
    _join(rank, world, port)
    texts = []
    for model in (nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), Wrapped()):
        try:
            torchspan.span(model, devices=["cpu", "cpu"], precision="fp16")
            texts.append("fp16: no error")
        except ValueError as exc:
            texts.append(f"fp16: {exc}")
    for label, model in (
        ("sequential", nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))),
        ("wrapper", Wrapped()),
    ):
        torch.manual_seed(rank)  # the mistake: each rank draws its own batch
        x = torch.randn(6, 4) if label == "sequential" else torch.randint(0, 30, (6, 5))
        y = torch.randn(6, 2) if label == "sequential" else torch.randint(0, 30, (6, 5))
        loss_fn = nn.MSELoss() if label == "sequential" else _token_ce
        spanned = torchspan.span(model, balance=[2, 1] if label == "sequential" else [3, 3], microbatches=2)
        inputs = x if label == "sequential" else {"ids": x}
        try:
            spanned.train_step(inputs, y, loss_fn, loss_reduction="mean")
            texts.append(f"{label}: no error")
        except ValueError as exc:
            texts.append(f"{label}: {exc}")
    Path(out, f"rank{rank}.txt").write_text("\n".join(texts))
    _leave()  # both refused and the group is intact


@pytest.mark.slow
def test_pipeline_ranks_refuse_different_batches_and_fp16_before_any_compute(tmp_path: Path) -> None:
    _spawn(_other_batch_worker, 2, free_port(), str(tmp_path), deadline=90.0)
    for rank in range(2):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        for label in ("sequential", "wrapper"):
            assert (
                f"{label}: rank(s) [1] of pipeline replica 0 were given another batch than rank 0" in text
            ), text
        assert text.count("fp16: precision='fp16' across ranks is not supported") == 2, text
