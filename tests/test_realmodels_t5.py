"""T5 (encoder-decoder, ``shared`` tied to both embeddings and the head) spanned over 4 stages on
``["cpu"]*4``: a dict batch with ``decoder_input_ids``, gradients and an optimizer step equal to one
device."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import torchspan  # noqa: E402


def _lm_loss(out: object, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten(), reduction="sum")  # type: ignore[attr-defined]


def test_t5_four_stages_tied_shared_gradients_and_step_equal_one_device() -> None:
    torch.manual_seed(0)
    cfg = transformers.T5Config(
        vocab_size=50,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = transformers.T5ForConditionalGeneration(cfg)
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    ids, dec = torch.randint(1, 50, (4, 6), generator=gen), torch.randint(1, 50, (4, 5), generator=gen)
    batch = {"input_ids": ids, "decoder_input_ids": dec, "use_cache": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spanned = torchspan.span(model, devices=["cpu"] * 4, microbatches=2)
    assert len(spanned.stages) == 4 and spanned.mode == "own-forward"
    layers = [name for _, group in spanned.stages for name in group]
    assert "encoder.block.1" in layers and "decoder.block.0" in layers and layers[-1] == "lm_head"
    opt, ref_opt = torch.optim.SGD(spanned.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = spanned.train_step(batch, dec, _lm_loss)
        ref_loss = _lm_loss(ref(**batch), dec)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-4, rtol=1e-5)
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert p.grad is not None and q.grad is not None, name
            torch.testing.assert_close(
                p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name
            )  # shared.weight: every use summed
        opt.step()
        ref_opt.step()
    assert model.encoder.embed_tokens.weight is model.shared.weight is model.decoder.embed_tokens.weight
    torch.testing.assert_close(model.shared.weight, ref.shared.weight)
    assert set(spanned.state_dict()) == set(ref.state_dict())


def test_an_explicit_balance_counts_the_layers_the_first_call_records() -> None:
    """T5's static layers (12: each stack's dropout too) are not its recorded ones (10): a balance over the
    recorded layers works, one over 12 is refused naming the 10."""
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
    model = transformers.T5ForConditionalGeneration(cfg).double()
    ref = copy.deepcopy(model)
    ids = torch.randint(1, 40, (4, 6), generator=torch.Generator().manual_seed(0))
    spanned = torchspan.span(model, devices=["cpu", "cpu"], balance=[5, 5], microbatches=2)
    loss = spanned.train_step({"input_ids": ids, "labels": ids})
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach().double(), rtol=1e-6, atol=1e-7)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-8, msg=name)
    wrong = torchspan.span(copy.deepcopy(ref), devices=["cpu", "cpu"], balance=[6, 6], microbatches=2)
    with pytest.raises(ValueError, match=r"balance=\[6, 6\] places 12 layers but the model has 10"):
        wrong.train_step({"input_ids": ids, "labels": ids})
