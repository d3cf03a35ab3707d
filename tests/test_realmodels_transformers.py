"""transformers models (random init, tiny configs built here, never downloaded) spanned over 4 stages:
blocks as layers, keyword/dict batches, gradients equal to one device (tied weight included),
tied weights identical after optimizer steps, a plan for a model no single device holds."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import torchspan  # noqa: E402

IDS = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(0))
MASK = torch.ones_like(IDS).index_fill_(1, torch.tensor([7]), 0)


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=4,
        n_embd=32,
        n_head=2,
        vocab_size=50,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _lm_loss(out: object, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten(), reduction="sum")  # type: ignore[attr-defined]


def _span(model: nn.Module, **kw: object) -> torchspan.Spanned:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torchspan.span(model, **kw)  # type: ignore[arg-type]


def _assert_same_grads(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_gpt2_blocks_on_four_stages_dict_batch_tied_gradient_and_steps() -> None:
    model = _gpt2()
    ref = copy.deepcopy(model)
    spanned = _span(model, devices=["cpu"] * 4, balance=[3, 2, 2, 2], microbatches=2)
    batch = {"input_ids": IDS, "attention_mask": MASK, "use_cache": False}
    opt = torch.optim.SGD(spanned.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = spanned.train_step(batch, IDS, _lm_loss)
        ref_loss = _lm_loss(ref(**batch), IDS)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-4, rtol=1e-5)
        _assert_same_grads(model, ref)  # transformer.wte.weight: the embedding's and the head's use summed
        opt.step()
        ref_opt.step()
    assert spanned.stages == [
        ("cpu", ["transformer.wte", "transformer.wpe", "transformer.drop"]),
        ("cpu", ["transformer.h.0", "transformer.h.1"]),
        ("cpu", ["transformer.h.2", "transformer.h.3"]),
        ("cpu", ["transformer.ln_f", "lm_head"]),
    ]
    assert model.lm_head.weight is model.transformer.wte.weight  # still one parameter after the steps
    torch.testing.assert_close(model.lm_head.weight, ref.lm_head.weight)
    assert sum(1 for _ in spanned.parameters()) == sum(
        1 for _ in ref.parameters()
    )  # the optimizer sees it once
    assert set(spanned.state_dict()) == set(ref.state_dict())  # tied keys kept
    assert "transformer.h.0" in str(spanned)


def test_gpt2_forward_returns_its_model_output_class() -> None:
    model = _gpt2()
    ref = copy.deepcopy(model)
    spanned = _span(model, devices=["cpu"] * 4, microbatches=2)
    with torch.no_grad():
        out = spanned(input_ids=IDS, attention_mask=MASK, use_cache=False)
        want = ref(input_ids=IDS, attention_mask=MASK, use_cache=False)
    assert type(out) is type(want)
    torch.testing.assert_close(out.logits, want.logits)


def test_llama_rotary_gqa_keyword_inputs_parity() -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
    )
    model = transformers.LlamaForCausalLM(cfg)
    ref = copy.deepcopy(model)
    spanned = _span(model, devices=["cpu"] * 4, microbatches=4)
    batch = {"input_ids": IDS, "attention_mask": MASK, "use_cache": False, "return_dict": True}
    spanned.train_step(batch, IDS, _lm_loss)
    _lm_loss(ref(**batch), IDS).backward()
    _assert_same_grads(model, ref)
    assert [g for _, g in spanned.stages][1:3] == [
        ["model.layers.0", "model.layers.1"],
        ["model.layers.2", "model.layers.3"],
    ]


def test_bert_classifier_dict_batch_parity() -> None:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        num_hidden_layers=4,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        vocab_size=50,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    model = transformers.BertForSequenceClassification(cfg)
    ref = copy.deepcopy(model)
    spanned = _span(model, devices=["cpu"] * 4, microbatches=2)
    labels = torch.tensor([0, 2, 1, 2])

    def loss_fn(out: object, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.logits, y)  # type: ignore[attr-defined]

    batch = {"input_ids": IDS, "attention_mask": MASK, "token_type_ids": torch.zeros_like(IDS)}
    spanned.train_step(batch, labels, loss_fn)
    loss_fn(ref(**batch), labels).backward()
    _assert_same_grads(model, ref)
    assert any(name.startswith("bert.encoder.layer.") for _, g in spanned.stages for name in g)


def test_plan_places_a_gpt2_no_single_device_holds_and_span_runs_it() -> None:
    model = _gpt2()
    ref = copy.deepcopy(model)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = int(total * 1.6)  # params + grads of the whole model need 2x: no device holds it alone
    batch = {"input_ids": IDS, "use_cache": False}
    plan = torchspan.plan(
        model,
        batch,
        devices="a100-40gb*4",
        memory={f"cuda:{i}": budget for i in range(4)},
        optimizer="sgd",
        microbatches=2,
        schedule="gpipe",
        recompute="never",
    )
    assert len(plan.stages) >= 2 and any(name.startswith("transformer.h.") for name in plan.layers)
    assert plan.layers == torchspan.layers.model_layers(model, (), batch).names()
    here = plan.to_dict()  # the same placement on this machine's CPU
    for st in here["stages"]:
        st["device"], st["device_name"] = "cpu", ""
    spanned = _span(model, plan=torchspan.Plan.from_dict(here))
    spanned.train_step(batch, IDS, _lm_loss)
    _lm_loss(ref(**batch), IDS).backward()
    _assert_same_grads(model, ref)
    assert [g for _, g in spanned.stages] == [st.layers for st in plan.stages]


def test_a_plan_for_other_layers_is_refused_at_the_first_call() -> None:
    model = _gpt2()
    spanned = _span(
        model,
        plan=torchspan.Plan.from_dict(
            {
                "stages": [
                    {"device": "cpu", "layers": ["transformer.wte", "transformer.wpe"]},
                    {
                        "device": "cpu",
                        "layers": [
                            "transformer.h.0",
                            "transformer.h.1",
                            "transformer.h.2",
                            "transformer.h.3",
                            "transformer.ln_f",
                            "lm_head",
                        ],
                    },
                ]
            }
        ),
    )
    with pytest.raises(ValueError, match="transformer.drop"):
        spanned(input_ids=IDS, use_cache=False)


def test_doctor_names_a_misplaced_block() -> None:
    model = _gpt2()
    model.transformer.h[2].to("meta")
    report = torchspan.doctor(model, input_ids=IDS, use_cache=False)
    assert not report.ok
    assert "transformer.h.2" in str(report)


def test_doctor_reports_a_tie_a_users_move_broke() -> None:
    model = _gpt2()
    assert not [f for f in torchspan.doctor(model).findings if f.code == "tie-broken"]
    model.lm_head.weight = nn.Parameter(
        model.lm_head.weight.detach().clone()
    )  # what a new-Parameter .to() leaves
    found = [f for f in torchspan.doctor(model).findings if f.code == "tie-broken"]
    assert len(found) == 1 and found[0].severity == "error"
    assert (
        "model.transformer.wte.weight and model.lm_head.weight" in found[0].title
        and "tie_weights" in found[0].fix
    )
