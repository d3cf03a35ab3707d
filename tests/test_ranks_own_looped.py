"""Several stages per rank (looped: stage s on rank s % 2) for the model's own forward across 2 gloo ranks.

GPT-2 and a GQA Llama (tied embedding and head: stages 0 and 3, on ranks 0 and 1) with 4 stages on 2 ranks:
each micro-batch's forward goes around the ring twice (0 -> 1 -> 0 -> 1) and its backward comes back in
segments. Every rank's gradients equal one device's (float64) for GPipe and 1F1B orders, 5 rows in 3 uneven
micro-batches, two sequence lengths, and its no-grad forward; schedules that split a backward in two are
refused on every rank (interleaved 1F1B: ``test_ranks_own_interleaved``).
"""

from __future__ import annotations

import pytest
import torch
from test_ranks_cuts import _gpt2, _join, _leave, _train_and_compare
from test_ranks_pipeline import _spawn

import torchspan
from torchspan.runtime.ranks import free_port
from torchspan.runtime.ranks.ownlooped import check_looped, common_plan, rank_groups

transformers = pytest.importorskip("transformers")


def _llama() -> torch.nn.Module:
    """GQA Llama with its head tied to the token embedding (stages 0 and 3: ranks 0 and 1)."""
    cfg = transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        max_position_embeddings=32,
        use_cache=False,
    )
    torch.manual_seed(3)
    return transformers.LlamaForCausalLM(cfg).double()


def _worker(rank: int, world: int, port: int) -> None:
    _join(rank, world, port)
    for schedule in ("1f1b", "gpipe"):
        label = f"gpt2 4 stages on 2 ranks, {schedule}"
        spanned = _train_and_compare(
            _gpt2, label, rank, False, balance=[2, 2, 2, 2], microbatches=3, schedule=schedule
        )
        held = {n for n, p in spanned.module.named_parameters() if p.device.type != "meta"}
        stages = (
            ("transformer.wte", "transformer.h.1") if rank == 0 else ("transformer.h.0.", "transformer.ln_f")
        )
        assert all(any(n.startswith(s) for n in held) for s in stages), (rank, sorted(held))
        assert spanned.balance == [2, 2, 2, 2]
    label = "llama 4 stages on 2 ranks, 1f1b"  # the rotary embedding on rank 1, read by stage 2 on rank 0
    spanned = _train_and_compare(
        _llama, label, rank, False, balance=[1, 2, 2, 2], microbatches=3, schedule="1f1b"
    )
    assert spanned.balance == [1, 2, 2, 2]
    with pytest.raises(ValueError, match=r"schedule='zero-bubble' with 4 stages on pp\(2\)"):
        torchspan.span(_gpt2(), balance=[2, 2, 2, 2], microbatches=2, schedule="zero-bubble")
    _leave()


@pytest.mark.slow
def test_four_own_forward_stages_on_two_ranks_match_one_device() -> None:
    _spawn(_worker, 2, free_port(), deadline=400.0)


def test_rank_groups_and_one_order_for_every_rank() -> None:
    assert rank_groups([["a"], ["b"], ["c", "d"], ["e"]], 2) == [["a", "c", "d"], ["b", "e"]]
    plan = common_plan("1f1b", 3, 2)
    assert [(a.kind, a.microbatch) for a in plan[0]] == [(a.kind, a.microbatch) for a in plan[1]]
    assert [a.stage for a in plan[1]] == [1] * 6
    with pytest.raises(ValueError, match="multiple of 2"):
        check_looped(3, 2, "1f1b", None, False)
    with pytest.raises(ValueError, match="schedule='zero-bubble'.*pass schedule='interleaved-1f1b', '1f1b'"):
        check_looped(4, 2, "zero-bubble", None, False)
    with pytest.raises(ValueError, match="shard=True"):
        check_looped(4, 2, "1f1b", None, True)
