"""The training loop transformers users write: ``train_step(batch)`` with ``labels`` in the batch, the
model's own ``output.loss``, exact against ``model(**batch).loss.backward()`` on one device for the whole
batch — micro-batches, uneven data-parallel shards and pipelines across ranks; what cannot split
exactly (an MoE router's auxiliary loss) refused before any backward. Also: declared reductions are
verified, and a refusal's advice is advice that works (issue 18 items 1, 5, 9).
"""

from __future__ import annotations

import copy
import functools
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from test_ranks_pipeline import _join, _leave, _spawn
from torch import nn

import torchspan
from torchspan.runtime.ranks import free_port

transformers = pytest.importorskip("transformers")

TOL = dict(
    rtol=1e-5, atol=1e-7
)  # transformers computes a causal LM's loss in float32 (logits.float()), even in a float64 model


def _ids(rows: int = 5, seq: int = 7, vocab: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed))


def _batch(rows: int = 5, seq: int = 7, seed: int = 0) -> dict[str, torch.Tensor]:
    """A collator's batch: padded rows (attention_mask 0, labels -100 where padded)."""
    ids = _ids(rows, seq, seed=seed)
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0
    mask[-1, 2:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _llama(tied: bool = True) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(cfg).double()


def _t5() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.T5Config(
        vocab_size=40,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(cfg).double()


def _bert(**kw: Any) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=40,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **kw,
    )
    return (
        transformers.BertForSequenceClassification(cfg)
        if "num_labels" in kw
        else transformers.BertForMaskedLM(cfg)
    ).double()


def _mixtral(aux: bool) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=aux,
        router_aux_loss_coef=0.02,
    )
    return transformers.MixtralForCausalLM(cfg)  # float32: the grouped expert matmul has no float64 kernel


def _span(model: nn.Module, **kw: Any) -> torchspan.Spanned:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torchspan.span(model, **kw)


def _same_grads(model: nn.Module, ref: nn.Module, tol: dict[str, float] = TOL) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------- one process
CASES = {
    "tied llama (causal LM, shifted labels)": (_llama, _batch),
    "t5 (encoder-decoder, labels unshifted)": (_t5, _batch),
    "bert masked LM (labels mostly -100)": (
        _bert,
        lambda: {**_batch(), "labels": _batch()["labels"].masked_fill(_ids(seed=3) % 3 != 0, -100)},
    ),
    "bert sequence classification": (
        functools.partial(_bert, num_labels=3),
        lambda: {**_batch(), "labels": torch.tensor([0, 2, 1, 1, 0])},
    ),
    "bert regression": (
        functools.partial(_bert, num_labels=1),
        lambda: {**_batch(), "labels": torch.linspace(-1, 1, 5, dtype=torch.float64)},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_own_loss_over_uneven_microbatches_equals_one_device(case: str) -> None:
    make, data = CASES[case]
    model, batch = make(), data()
    ref = copy.deepcopy(model)
    spanned = _span(model, devices=["cpu", "cpu"], microbatches=3)  # 5 rows: 2, 2, 1
    loss = spanned.train_step(batch)
    want = ref(**batch).loss
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach().double(), rtol=1e-6, atol=1e-7)
    _same_grads(model, ref)
    out = spanned(**batch)  # the forward users call: its loss is the whole batch's too
    torch.testing.assert_close(out.loss.double(), want.detach().double(), **TOL)


def test_the_loop_users_write_several_steps_and_a_new_length() -> None:
    model = _llama()
    ref = copy.deepcopy(model)
    spanned = _span(model, devices=["cpu", "cpu"], microbatches=2, schedule="1f1b")
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (spanned, ref))
    for step, seq in enumerate([7, 7, 5]):
        batch = _batch(seq=seq, seed=step)
        opt.zero_grad()
        ref_opt.zero_grad()
        spanned.train_step(batch)
        ref(**batch).loss.backward()
        _same_grads(model, ref)
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TOL)


def test_a_chunk_whose_labels_are_all_padding_adds_zero_not_nan() -> None:
    model = _llama()
    ref = copy.deepcopy(model)
    batch = _batch(rows=4)
    batch["labels"][2:] = -100  # the second micro-batch has nothing to predict
    spanned = _span(model, devices=["cpu", "cpu"], microbatches=2)
    loss = spanned.train_step(batch)
    want = ref(**batch).loss
    want.backward()
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss.double(), want.detach().double(), rtol=1e-6, atol=1e-7)
    _same_grads(model, ref)


def test_an_moe_auxiliary_loss_is_refused_over_a_split_batch_and_exact_in_one_chunk() -> None:
    batch = _batch()
    spanned = _span(_mixtral(aux=True), devices=["cpu", "cpu"], microbatches=3)
    before = [p.detach().clone() for p in spanned.parameters()]
    with pytest.raises(ValueError, match="auxiliary loss.*router"):
        spanned.train_step(batch)
    assert all(p.grad is None for p in spanned.parameters())  # refused before any backward
    assert all(torch.equal(p, b) for p, b in zip(spanned.parameters(), before))
    # one chunk on one process: the model's loss (router loss included) is the loss
    model = _mixtral(aux=True)
    ref = copy.deepcopy(model)
    torchspan.span(model).train_step(batch)
    ref(**batch).loss.backward()
    _same_grads(model, ref, dict(rtol=1e-5, atol=1e-6))
    # without the auxiliary loss an MoE decoder splits exactly
    model = _mixtral(aux=False)
    ref = copy.deepcopy(model)
    _span(model, devices=["cpu", "cpu"], microbatches=3).train_step(batch)
    ref(**batch).loss.backward()
    _same_grads(model, ref, dict(rtol=1e-5, atol=1e-6))


def test_your_own_loss_on_a_batch_that_still_holds_labels() -> None:
    model = _llama()
    ref = copy.deepcopy(model)
    batch = _batch()

    def shifted_mean(out: Any, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), y[:, 1:].flatten())

    spanned = _span(model, devices=["cpu", "cpu"], microbatches=3)
    loss = spanned.train_step(
        batch, batch["labels"], shifted_mean, loss_normalizer=lambda y: (y[..., 1:] != -100).sum()
    )
    want = shifted_mean(ref(**batch), batch["labels"])
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach().double(), rtol=1e-6, atol=1e-7)
    _same_grads(model, ref)


def test_own_loss_mistakes_get_one_line_fixes() -> None:
    spanned = _span(_llama(), devices=["cpu", "cpu"], microbatches=2)
    batch = _batch()
    with pytest.raises(ValueError, match=r"needs batch\['labels'\].*train_step\(inputs, target, loss_fn\)"):
        spanned.train_step({k: v for k, v in batch.items() if k != "labels"})
    with pytest.raises(ValueError, match="drop target"):
        spanned.train_step(batch, batch["labels"])
    with pytest.raises(ValueError, match="verified against its logits"):
        spanned.train_step(batch, loss_reduction="mean")


# ---------------------------------------------------------------------- declarations and advice (items 5, 9)
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def test_a_declared_reduction_is_verified_not_trusted() -> None:
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    mean = lambda out, t: ((out - t) ** 2).mean()  # noqa: E731
    spanned = _span(_mlp(), devices=["cpu", "cpu"], microbatches=3)
    with pytest.raises(
        ValueError,
        match=r"loss_reduction='sum' is declared.*full-batch loss is [0-9.]+, while .* give [0-9.]+ weighted "
        r"as declared",
    ):
        spanned.train_step(x, y, mean, loss_reduction="sum")
    assert all(p.grad is None for p in spanned.parameters())
    model = _mlp()
    ref = copy.deepcopy(model)
    _span(model, devices=["cpu", "cpu"], microbatches=3).train_step(x, y, mean, loss_reduction="mean")
    mean(ref(x), y).backward()
    _same_grads(model, ref)


def test_the_shifted_token_mean_refusal_suggests_the_normalizer_that_works() -> None:
    batch = _batch()
    labels = batch.pop("labels")

    def shifted_mean(out: Any, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), y[:, 1:].flatten())

    spanned = _span(_llama(), devices=["cpu", "cpu"], microbatches=3)
    with pytest.raises(ValueError) as refused:
        spanned.train_step(batch, labels, shifted_mean)
    message = str(refused.value)
    assert "loss_normalizer=lambda y: (y[..., 1:] != -100).sum() reproduces it (checked)" in message
    with pytest.raises(ValueError) as wrong:  # the advice it gave before: counts the first position too
        spanned.train_step(batch, labels, shifted_mean, loss_normalizer=lambda y: (y != -100).sum())
    assert "(y[..., 1:] != -100).sum()" in str(wrong.value)
    model = _llama()
    ref = copy.deepcopy(model)
    _span(model, devices=["cpu", "cpu"], microbatches=3).train_step(
        batch, labels, shifted_mean, loss_normalizer=lambda y: (y[..., 1:] != -100).sum()
    )
    shifted_mean(ref(**batch), labels).backward()
    _same_grads(model, ref)


# ---------------------------------------------------------------------- across ranks
def _dp_worker(rank: int, world: int, port: int, out: str) -> None:
    try:
        _join(rank, world, port)
        for name in (
            "tied llama (causal LM, shifted labels)",
            "t5 (encoder-decoder, labels unshifted)",
            "bert sequence classification",
        ):
            make, data = CASES[name]
            batch = data()
            ref = make()
            ref(**batch).loss.backward()
            spanned = torchspan.span(make())  # a data-parallel replica per rank
            shard = torchspan.shard_batch(batch, rank, world)  # 3 rows and 2 rows
            for _ in range(2):  # the second step reuses the verified loss (no collective for it)
                spanned.module.zero_grad()
                loss = spanned.train_step(shard)
                torch.testing.assert_close(
                    loss.double(), ref(**batch).loss.detach().double(), rtol=1e-6, atol=1e-7
                )
                _same_grads(spanned.module, ref)
        # an MoE decoder without its router loss, over shards of 2 and 1 rows, then an epoch end: rank 1's
        # shard is empty (rank_batches), and a transformers model cannot run zero rows: it runs one stand-in
        # row at weight 0
        spanned = torchspan.span(_mixtral(aux=False))
        for rows in (3, 1):
            batch = _batch(rows=rows, seed=rows)
            ref = _mixtral(aux=False)
            ref(**batch).loss.backward()
            spanned.module.zero_grad()
            spanned.train_step(torchspan.shard_batch(batch, rank, world))
            _same_grads(spanned.module, ref, dict(rtol=1e-5, atol=1e-6))
        _leave()
    except BaseException:
        Path(out, f"rank{rank}.txt").write_text(traceback.format_exc())
        raise


def test_own_loss_data_parallel_over_uneven_shards(tmp_path: Path) -> None:
    _spawn(_dp_worker, 2, free_port(), str(tmp_path), deadline=180.0)
    assert not list(tmp_path.glob("rank*.txt"))


def _pipe_worker(rank: int, world: int, port: int, out: str) -> None:
    try:
        _join(rank, world, port)
        batch = _batch(rows=5)
        ref = _llama()
        want = ref(**batch).loss
        want.backward()
        spanned = _span(
            _llama(), devices=["cpu", "cpu"], microbatches=3, schedule="1f1b"
        )  # one stage per rank
        loss = spanned.train_step(batch)
        torch.testing.assert_close(loss.double(), want.detach().double(), rtol=1e-6, atol=1e-7)
        held = {n for n, p in spanned.module.named_parameters() if p.device.type != "meta"}
        for name, p in spanned.module.named_parameters():
            if name in held:
                torch.testing.assert_close(p.grad, dict(ref.named_parameters())[name].grad, **TOL)
        _leave()
    except BaseException:
        Path(out, f"rank{rank}.txt").write_text(traceback.format_exc())
        raise


def test_own_loss_pipeline_across_two_ranks(tmp_path: Path) -> None:
    _spawn(_pipe_worker, 2, free_port(), str(tmp_path), deadline=180.0)
    assert not list(tmp_path.glob("rank*.txt"))


# ---------------------------------------------------------------------- bad input gets one line (issue 19
# item 3)
class _Returns(nn.Module):
    def __init__(self, what: str) -> None:
        super().__init__()
        self.what, self.lin = what, nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> Any:
        out = self.lin(x)
        return None if self.what == "none" else float(out.sum())


def test_train_step_bad_input_is_named() -> None:
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    spanned = _span(_mlp().float(), devices=["cpu", "cpu"], microbatches=2)
    with pytest.raises(ValueError, match=r"target=None, loss_fn=MSELoss.*pass the target"):
        spanned.train_step(x, None, nn.MSELoss())
    spanned.train_step(
        x, None, lambda out, _: out.pow(2).mean(), loss_reduction="mean"
    )  # a loss that needs no target
    with pytest.raises(ValueError, match="forward returned None, which holds no tensor"):
        torchspan.span(_Returns("none")).train_step(x, y, nn.MSELoss())
    with pytest.raises(ValueError, match=r"forward returned a float \(.*\), which holds no tensor"):
        _span(_Returns("float"), microbatches=2).train_step(x, y, nn.MSELoss())
    with pytest.raises(ValueError, match="stage.s. on meta: meta tensors hold shapes, not values"):
        _span(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), devices=["cpu", "meta"]).train_step(
            x, y, nn.MSELoss()
        )
