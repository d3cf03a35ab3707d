"""Cuts between any two layers of the own-forward pipeline across gloo ranks.

A cut right after the token embedding puts the token and position embeddings on different ranks:
the model's own code adds them (``inputs_embeds + position_embeds``) before the next layer, a value
no rank holds. The owner of the next layer now receives the operand it lacks and replays the glue
op (``runtime.ranks.glue``); a value the glue changed in place after combining is refused on every
rank, naming the cut and a balance that works (which is then followed), and a rank failing in the
model's code between layers stops every rank at the next exchange. GPT-2 with ``balance=[1, 7]``
and BART's default even split (which lands right after the decoder's token embedding) match one
device in float64; so does a skip connection across the cut. A last stage holding only layers the
forward never calls is refused at the first step on every rank.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from test_ranks_pipeline import TOL, _check, _spawn
from torch import nn

import torchspan
from torchspan.runtime.ranks import free_port, init_distributed
from torchspan.runtime.ranks.routes import GRAD, META, Seen, Transfer, route_call

transformers = pytest.importorskip("transformers")

LOSS_TOL = dict(rtol=1e-6, atol=1e-7)


def _join(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    init_distributed(timeout=30)


def _leave() -> None:
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def shifted_mean(out, labels: torch.Tensor) -> torch.Tensor:
    """The causal-LM token mean on the logits (position t predicts token t + 1)."""
    logits = out.logits if hasattr(out, "logits") else out
    return nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
    )


def shifted_tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels[:, 1:] != -100).sum()


def step_like_one_device(
    spanned: torchspan.Spanned,
    reference: nn.Module,
    inputs: dict,
    labels: torch.Tensor,
    label: str,
    rank: int,
) -> None:
    """One ``train_step`` on the shifted token mean beside the same step of ``reference`` on one device:
    the loss and this rank's gradients equal (gradients cleared first on both)."""
    for p in [*spanned.module.parameters(), *reference.parameters()]:
        p.grad = None
    loss = spanned.train_step(inputs, labels, shifted_mean, loss_normalizer=shifted_tokens)
    expected = shifted_mean(reference(**inputs), labels)
    expected.backward()
    torch.testing.assert_close(loss.double(), expected.detach(), **LOSS_TOL)
    assert _check(spanned, reference, label, rank) > 0


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
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(1)
    return transformers.GPT2LMHeadModel(cfg).double()


def _bart() -> nn.Module:
    cfg = transformers.BartConfig(
        vocab_size=40,
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=24,
        decoder_ffn_dim=24,
        max_position_embeddings=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        use_cache=False,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
    )
    torch.manual_seed(2)
    return transformers.BartForConditionalGeneration(cfg).double()


def _inputs(
    seed: int, rows: int, length: int, encoder_decoder: bool
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 40, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[1, -2:] = 0
    if not encoder_decoder:
        labels = ids.clone()
        labels[0, :3] = -100
        return {"input_ids": ids, "attention_mask": mask}, labels
    dec = torch.randint(3, 40, (rows, length - 1), generator=g)
    labels = dec.clone()
    labels[0, :2] = -100
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec}, labels


def _train_and_compare(make, label: str, rank: int, encoder_decoder: bool, **span_args) -> torchspan.Spanned:
    model = make()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, **span_args)
    for step, length in enumerate((7, 5)):  # a second sequence length: new shapes through the same routes
        inputs, labels = _inputs(10 + step, 5, length, encoder_decoder)  # 5 rows in 3 micro-batches
        step_like_one_device(spanned, reference, inputs, labels, f"{label} step {step}", rank)
    with torch.no_grad():
        inputs, _ = _inputs(30, 3, 6, encoder_decoder)
        torch.testing.assert_close(spanned(**inputs).logits, reference(**inputs).logits, **TOL)
    return spanned


def _decoders_worker(rank: int, world: int, port: int) -> None:
    _join(rank, world, port)
    spanned = _train_and_compare(
        _gpt2, "gpt2 [1, 7]", rank, False, balance=[1, 7], microbatches=3, schedule="1f1b"
    )
    assert spanned.balance == [1, 7]
    spanned = _train_and_compare(_bart, "bart even split", rank, True, devices=["cpu", "cpu"], microbatches=3)
    assert spanned.balance[0] == 6  # the cut lands right after the decoder's token embedding
    # The last stage holds the head only: the encoder's output it returns comes from stage 0.
    reference = _bart()
    spanned = torchspan.span(_bart(), balance=[10, 2], microbatches=2)
    inputs, _ = _inputs(40, 3, 6, True)
    with torch.no_grad():
        got, want = spanned(**inputs), reference(**inputs)
    torch.testing.assert_close(got.encoder_last_hidden_state, want.encoder_last_hidden_state, **TOL)
    torch.testing.assert_close(got.logits, want.logits, **TOL)
    _leave()


@pytest.mark.slow
def test_cuts_after_the_token_embedding_across_two_ranks_match_one_device() -> None:
    _spawn(_decoders_worker, 2, free_port(), deadline=300.0)


# ---------------------------------------------------------------------- in process: taint, glue recipes,
# routes
def test_glue_ops_on_another_stages_values_are_recorded_and_replayed_with_gradients() -> None:
    from torchspan.runtime.ranks.glue import Recipes
    from torchspan.runtime.ranks.taint import MetaTaint

    tok = torch.empty(2, 3, device="meta")  # stage 0's token embedding, as stage 1 sees it
    pos = torch.randn(3, requires_grad=True)  # stage 1's own position embedding
    recipes = Recipes()
    with MetaTaint(torch.device("cpu"), recipes):
        moved = tok.to(
            pos.device
        )  # another stage's value moved to a real device stays another stage's (itself)
        assert moved.is_meta and tok.cpu().is_meta
        h = moved + pos.to(moved.device)  # the cut right after the token embedding: held by no rank
        scaled = h * 2.0
    assert h.is_meta
    tree = recipes.tree(scaled, lambda t: (0 if t.is_meta else 2, t.dtype), lambda t: None)
    assert tree[2][0][2][1][0] == 2  # scaled = h * 2; h = moved + pos: pos held here (with grad)
    got_tok = torch.randn(2, 3, requires_grad=True)  # what stage 0 sends
    value = recipes.rebuild(
        scaled, {(0, 0): got_tok}, lambda t: None if t.is_meta else t, torch.device("cpu")
    )
    torch.testing.assert_close(value, (got_tok + pos) * 2.0)
    value.sum().backward()
    torch.testing.assert_close(got_tok.grad, torch.full((2, 3), 2.0))
    torch.testing.assert_close(pos.grad, torch.full((3,), 4.0))
    with MetaTaint(torch.device("cpu"), recipes):
        h.mul_(3.0)  # changed in place: what made it can no longer be replayed
    assert (
        recipes.rebuild(h, {(0,): got_tok}, lambda t: None if t.is_meta else t, torch.device("cpu")) is None
    )


def test_glue_finds_another_stages_values_in_flat_and_nested_arguments() -> None:
    from torch.utils._pytree import tree_leaves

    from torchspan.runtime.ranks.taint import MetaTaint, _tensor_leaves

    meta, real = torch.empty(2, 3, device="meta"), torch.randn(2, 3)
    with MetaTaint(torch.device("cpu")):
        assert (
            torch.add(real, meta, alpha=2).is_meta and torch.cat([real, meta]).is_meta
        )  # flat; nested in a list
        assert torch.stack((real, real)).device.type == "cpu" and real[..., 1:].device.type == "cpu"
    for args, kwargs in [
        ((real, 1, None), {}),
        ((real, [meta, real]), {"dim": 0}),
        ((real, torch.Size([2])), {"out": meta}),
        ((real, slice(0, 1), ...), {}),
        ((real, {"a": meta}), {}),
        ((), {"x": (real, meta)}),
    ]:
        want = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        got = _tensor_leaves(args, kwargs)
        assert len(got) == len(want) and all(a is b for a, b in zip(got, want)), (args, kwargs)


def test_routes_rebuild_a_value_no_stage_holds_from_the_operands_earlier_stages_hold() -> None:
    from torchspan.runtime.ranks.routes import resolve_rebuilds

    seen = [Seen("block", (META,), (None,)), Seen("block", (META,), (None,))]
    route = route_call(4, "block", 1, seen, pending=True)
    assert route.unresolved == [0] and not route.transfers
    # h = tok + pos: stage 0 holds tok (with grad), stage 1 holds pos
    trees = [
        {
            0: (
                META,
                torch.float64,
                ((GRAD, torch.float64, None, "tok", False), (META, torch.float64, None, "pos", False)),
                None,
                True,
            )
        },
        {
            0: (
                META,
                torch.float64,
                ((META, torch.float64, None, "tok", False), (GRAD, torch.float64, None, "pos", False)),
                None,
                True,
            )
        },
    ]
    resolve_rebuilds(route, trees)
    assert route.rebuilds == [0] and route.transfers == [Transfer(0, 0, 1, True, torch.float64, (0,))]
    changed = [{0: (*t[0][:4], False)} for t in trees]  # h changed in place after it was made
    route = route_call(4, "block", 1, seen, pending=True)
    with pytest.raises(
        ValueError,
        match=r"made from the outputs of 'tok', 'pos', and cannot be recomputed on stage 1: it was changed "
        r"in place",
    ) as err:
        resolve_rebuilds(route, changed, lambda layers: f"Keep {' and '.join(layers)} together")
    assert "Keep tok and pos together, or do the combination inside a layer" in str(err.value)


# ---------------------------------------------------------------------- small models: skip connections,
# refusals
class Embedded(nn.Module):
    """Token and position embeddings added by the model's own code; ``in_place`` scales the sum in place."""

    def __init__(self, in_place: bool = False, skip: bool = False) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.tok, self.pos = nn.Embedding(20, 6), nn.Embedding(8, 6)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(6, 20)
        self.in_place, self.skip = in_place, skip
        self.double()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        h = self.tok(ids) + self.pos(positions)
        if self.in_place:
            h *= 2.0
        first = h
        for block in self.blocks:
            h = block(h)
        return self.head(
            h + first if self.skip else h
        )  # a skip across the cut when the blocks sit on stage 1


class Peeks(nn.Module):
    """The model's own code branches on a value of stage 0's block: stage 1 cannot (it is meta there)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](x)
        if h.sum() > 0:
            h = h * 2
        return self.blocks[1](h)


def _small_worker(rank: int, world: int, port: int, out: str) -> None:
    _join(rank, world, port)
    g = torch.Generator().manual_seed(5)
    ids, labels = torch.randint(0, 20, (5, 6), generator=g), torch.randint(0, 20, (5, 6), generator=g)
    lines = []
    for label, model, balance in (("skip", Embedded(skip=True), [2, 3]), ("split sum", Embedded(), [1, 4])):
        reference = copy.deepcopy(model)
        spanned = torchspan.span(model, balance=balance, microbatches=3)
        loss = spanned.train_step({"ids": ids}, labels, shifted_mean, loss_normalizer=shifted_tokens)
        expected = shifted_mean(reference(ids), labels)
        expected.backward()
        torch.testing.assert_close(loss.double(), expected.detach(), **LOSS_TOL)
        assert _check(spanned, reference, label, rank) > 0
    for label, make, balance in (
        ("in place", lambda: Embedded(in_place=True), [1, 4]),
        ("bart", _bart, [11, 1]),
    ):
        try:
            spanned = torchspan.span(make(), balance=balance, microbatches=2)
            inputs, y = ({"ids": ids}, labels) if label == "in place" else _inputs(1, 4, 6, True)
            spanned.train_step(inputs, y, shifted_mean, loss_normalizer=shifted_tokens)
            lines.append(f"{label}: no error")
        except ValueError as exc:
            lines.append(f"{label}: {exc}")
    try:  # fails on stage 1 only, between layer calls: every rank stops at its next exchange
        torchspan.span(Peeks(), balance=[1, 1], microbatches=2).train_step(
            torch.randn(4, 4), torch.randn(4, 4), nn.MSELoss()
        )
        lines.append("peeks: no error")
    except RuntimeError as exc:
        lines.append(f"peeks: {exc}")
    model = Embedded(in_place=True)  # the advice followed
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, balance=[2, 3], microbatches=3)
    spanned.train_step({"ids": ids}, labels, shifted_mean, loss_normalizer=shifted_tokens)
    shifted_mean(reference(ids), labels).backward()
    assert _check(spanned, reference, "in place, advice followed", rank) > 0
    Path(out, f"rank{rank}.txt").write_text("\n".join(lines))
    _leave()  # every rank refused in the same step: the group is intact


@pytest.mark.slow
def test_skip_connections_across_the_cut_and_refusals_on_every_rank(tmp_path: Path) -> None:
    took = _spawn(_small_worker, 2, free_port(), str(tmp_path), deadline=180.0)
    for rank in range(2):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        assert (
            "in place: torchspan: layer 'blocks.0' (stage 1) reads tensor argument 0, which no single "
            "stage computes"
            in text
            and "it is made from the outputs of 'tok', 'pos'" in text
            and "it was changed in place after it was made" in text
            and "The cut between 'tok' and 'pos' separates them: use balance=[2, 3] with the same devices"
            in text
        ), text
        assert (
            "bart: torchspan: the last pipeline stage holds only layers the model's forward does not call "
            "('model.shared')"
            in text
            and "use balance=[10, 2] with the same devices" in text
        ), text
    other, failing = ((tmp_path / f"rank{r}.txt").read_text() for r in range(2))
    assert "peeks: torchspan: rank 1 (stage 1) failed in micro-batch 0's forward, and every rank" in other, (
        other
    )
    assert (
        "Tensor.item() cannot be called on meta tensors" in other and "must not read them (.item()" in other
    ), other
    assert "peeks: torchspan: stage 1 cannot run the model's own code at micro-batch 0" in failing, failing
    assert took < 150
