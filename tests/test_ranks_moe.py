"""MoE decoders across gloo ranks (the own-forward pipeline): routing that depends on values.

An MoE block picks each token's experts from the router's values (``nonzero``/``torch.where`` over
the tokens each expert takes, a loop over the experts hit), which ``meta`` cannot run: the ranks that
run another stage's MoE block take its outputs' shapes from the rank that runs it for real
(``runtime.ranks.metacalls.Described``), once per call shape. Every spawned rank compares the
gradients of the parameters it holds with one device on the whole batch in float64 (uneven
micro-batches, two sequence lengths, a shifted token-mean loss on the logits; router logits recorded
by hooks inside the blocks, which the other ranks fire again on replayed calls); a layer that cannot
be described is refused on every rank at the first step, and a layer that fails for real stops the
ranks waiting for it, naming it.
"""

from __future__ import annotations

import copy
import traceback
import warnings
from pathlib import Path

import pytest
import torch
from test_ranks_cuts import _join, _leave, step_like_one_device
from test_ranks_pipeline import TOL, _spawn
from torch import nn

import torchspan
from torchspan.runtime.ranks import free_port

transformers = pytest.importorskip("transformers")


def _mixtral(experts: str = "eager") -> nn.Module:
    """Router logits recorded (output_router_logits): by hooks inside the blocks, which other ranks replay."""
    cfg = transformers.MixtralConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        use_cache=False,
        tie_word_embeddings=False,
        experts_implementation=experts,
        output_router_logits=True,
    )
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg).double()


def _qwen_moe() -> nn.Module:
    """Qwen2-MoE: top-k experts plus a gated shared expert in every block."""
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=24,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=12,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        use_cache=False,
        experts_implementation="eager",
    )
    torch.manual_seed(1)
    return transformers.Qwen2MoeForCausalLM(cfg).double()


def _batch(seed: int, rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 40, (rows, length), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[1, -2:] = 0
    return ids, labels, mask


def _train_and_compare(make, label: str, rank: int, **span_args) -> None:
    model = make()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, **span_args)
    for step, length in enumerate((7, 5)):  # a second sequence length: new call shapes, described again
        ids, labels, mask = _batch(10 + step, 5, length)  # 5 rows in 3 micro-batches: 2 + 2 + 1
        inputs = {"input_ids": ids, "attention_mask": mask}
        step_like_one_device(spanned, reference, inputs, labels, f"{label} step {step}", rank)
    with (
        torch.no_grad(),
        warnings.catch_warnings(record=True) as caught,
    ):  # a forward: the last stage's outputs on every rank
        warnings.simplefilter("always")
        ids, _, mask = _batch(30, 3, 6)
        got, want = spanned(input_ids=ids, attention_mask=mask), reference(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(got.logits, want.logits, **TOL)
    if getattr(want, "router_logits", None) is not None:  # each block's, from the stage that runs it
        assert len(got.router_logits) == len(want.router_logits)
        for mine, theirs in zip(got.router_logits, want.router_logits):
            torch.testing.assert_close(mine, theirs, **TOL)
        assert got.aux_loss is None  # combines every block's router logits: no rank holds it
        assert any(
            "output ['aux_loss'] combines values of several pipeline stages" in str(w.message) for w in caught
        )


def _moe_worker(rank: int, world: int, port: int) -> None:
    _join(rank, world, port)
    _train_and_compare(
        _mixtral, "mixtral 1f1b", rank, devices=["cpu", "cpu"], microbatches=3, schedule="1f1b"
    )
    _train_and_compare(_qwen_moe, "qwen2-moe gpipe", rank, balance=[3, 5], microbatches=3, schedule="gpipe")
    _leave()


@pytest.mark.slow
def test_moe_decoders_across_two_ranks_match_one_device() -> None:
    _spawn(_moe_worker, 2, free_port(), deadline=300.0)


# ---------------------------------------------------------------------- refused, on every rank
class Routed(nn.Module):
    """Value-dependent routing (as an MoE block's): cannot run on meta. ``extra`` returns an object beside
    the tensor (which no shape describes); ``fails`` raises when it runs for real in the pipeline."""

    def __init__(self, extra: bool = False, fails: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.extra, self.fails = extra, fails
        self.calls = 0

    def forward(self, h: torch.Tensor):
        picked = torch.nonzero(h[:, 0] > 0).flatten()
        self.calls += 1
        if self.fails and self.calls > 1:  # not in the recording forward every rank runs first
            raise RuntimeError("boom in a routed block")
        out = h.index_add(0, picked, self.lin(h[picked]))
        return (out, Path("state")) if self.extra else out


class Net(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), block, nn.Linear(4, 2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
            x = x[0] if isinstance(x, tuple) else x
        return x


def _refused_worker(rank: int, world: int, port: int, out: str) -> None:
    _join(rank, world, port)
    texts = []
    for label, block in (("object", Routed(extra=True)), ("fails", Routed(fails=True))):
        spanned = torchspan.span(Net(block), balance=[2, 2], microbatches=2)
        try:
            spanned.train_step(torch.randn(4, 4), torch.randn(4, 2), nn.MSELoss())
            texts.append(f"{label}: no error")
        except Exception as exc:  # noqa: BLE001 - what each rank raised, compared by the test
            texts.append(
                f"{label}: {type(exc).__name__}: {exc}"
                + ("" if "torchspan" in str(exc) else traceback.format_exc())
            )
    Path(out, f"rank{rank}.txt").write_text("\n".join(texts))
    _leave()  # every rank raised in the same step: the group is intact


@pytest.mark.slow
def test_a_layer_meta_cannot_run_is_refused_or_stops_on_every_rank(tmp_path: Path) -> None:
    took = _spawn(_refused_worker, 2, free_port(), str(tmp_path), deadline=120.0)
    owner, other = ((tmp_path / f"rank{r}.txt").read_text() for r in (1, 0))
    refusal = (
        "layer 'blocks.2' (stage 1) cannot run on meta on the other ranks of the pipeline (stage 0: "
        "NotImplementedError"
    )
    for text in (owner, other):
        assert (
            refusal in text
            and "its outputs cannot be described to them by their shapes: it returns PosixPath" in text
        ), text
    assert "fails: RuntimeError: boom in a routed block" in owner, owner
    assert "fails: RuntimeError: torchspan: stage 1 (rank 1) failed running layer 'blocks.2'" in other, other
    assert "boom in a routed block" in other
    assert took < 100
