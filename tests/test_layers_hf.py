"""transformers models (random init, built here, never downloaded): blocks as layers, coverage, ties."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from torchspan.layers.blocks import LayerSet, find_layers, param_layers  # noqa: E402
from torchspan.layers.ties import find_ties  # noqa: E402

IDS = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))


def _covers_once(model: nn.Module, layers: LayerSet) -> None:
    owner = param_layers(model, layers)
    assert sorted(owner) == sorted(n for n, _ in model.named_parameters(remove_duplicate=False))
    assert layers.roots == ()
    by_layer = sum(len(list(layer.module.named_parameters(remove_duplicate=False))) for layer in layers)
    assert by_layer == len(owner)  # every qualified name in exactly one layer
    assert all(
        owner[n] == layer.name
        for layer in layers
        for n in (f"{layer.name}.{p}" for p, _ in layer.module.named_parameters(remove_duplicate=False))
    )


def test_gpt2_blocks_and_tied_embedding() -> None:
    cfg = transformers.GPT2Config(
        n_layer=4, n_embd=32, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    m = transformers.GPT2LMHeadModel(cfg)
    layers = find_layers(m, IDS)
    blocks = [f"transformer.h.{i}" for i in range(4)]
    assert layers.names() == [
        "transformer.wte",
        "transformer.wpe",
        "transformer.drop",
        *blocks,
        "transformer.ln_f",
        "lm_head",
    ]
    _covers_once(m, layers)
    (tie,) = find_ties(m, layers)
    assert tie.name == "transformer.wte.weight" and tie.layers == ("transformer.wte", "lm_head")
    assert {(a.name, a.layer) for a in tie.aliases} == {
        ("transformer.wte.weight", "transformer.wte"),
        ("lm_head.weight", "lm_head"),
    }
    assert layers.by_name("transformer.h.0").param_count == sum(
        p.numel() for p in m.transformer.h[0].parameters()
    )


def test_llama_blocks_rotary_and_no_tie() -> None:
    cfg = transformers.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
    )
    m = transformers.LlamaForCausalLM(cfg)
    layers = find_layers(m, IDS, attention_mask=torch.ones_like(IDS))
    blocks = [f"model.layers.{i}" for i in range(4)]
    assert layers.names() == ["model.embed_tokens", "model.rotary_emb", *blocks, "model.norm", "lm_head"]
    assert (
        layers.by_name("model.rotary_emb").param_count == 0
        and layers.by_name("model.rotary_emb").buffer_bytes > 0
    )
    _covers_once(m, layers)
    assert find_ties(m, layers) == []


def test_bert_classifier_blocks_pooler_head() -> None:
    cfg = transformers.BertConfig(
        num_hidden_layers=4,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        vocab_size=50,
        max_position_embeddings=16,
    )
    m = transformers.BertForSequenceClassification(cfg)
    layers = find_layers(m, IDS, attention_mask=torch.ones_like(IDS))
    blocks = [f"bert.encoder.layer.{i}" for i in range(4)]
    assert layers.names() == ["bert.embeddings", *blocks, "bert.pooler", "dropout", "classifier"]
    _covers_once(m, layers)
    assert find_ties(m, layers) == []
    # the old behaviour on request: the backbone kept whole
    assert find_layers(m, IDS, no_split=[transformers.BertModel]).names() == ["bert", "dropout", "classifier"]


def test_t5_encoder_decoder_blocks_and_shared_embedding() -> None:
    cfg = transformers.T5Config(
        vocab_size=50, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0
    )
    m = transformers.T5ForConditionalGeneration(cfg)
    layers = find_layers(m, input_ids=IDS, decoder_input_ids=IDS)
    assert layers.names() == [
        "encoder.embed_tokens",
        "encoder.block.0",
        "encoder.block.1",
        "encoder.final_layer_norm",
        "decoder.embed_tokens",
        "decoder.block.0",
        "decoder.block.1",
        "decoder.final_layer_norm",
        "lm_head",
        "shared",
    ]
    assert [layer.ran for layer in layers][-2:] == [True, False]  # `shared` is never called itself
    assert layers.skipped == ("encoder.dropout", "decoder.dropout")  # stateless, each applied twice
    _covers_once(m, layers)
    ties = find_ties(m, layers)
    tied = m.shared.weight is m.lm_head.weight
    assert [t.name for t in ties] == ["shared.weight"]
    expected = ["encoder.embed_tokens", "decoder.embed_tokens"] + (["lm_head"] if tied else []) + ["shared"]
    assert list(ties[0].layers) == expected
