"""The model's own forward (a transformers decoder) on pipeline replicas reduces in DDP's buckets.

4 gloo ranks, 2 stages x 2 replicas of a tied GQA Llama (``test_ranks_hooks._llama``, float64), uneven
shards (4 + 2 rows), 2 micro-batches: under 1F1B, GPipe and zero-bubble (armed before the last weight pass)
each stage's untied parameters go through the reducer (``ranks.bucketed``; ``used`` counts those its hooks
took, so the test fails if the path is skipped), merged-weights stays flat. The gradients are bit-equal to
the flat reduction's (``RankStage.bucketed = False``) and equal one device's; the loss is the full batch's.
"""

from __future__ import annotations

import pytest
import torch
from test_ranks_hooks import LOSS_TOL, _batch, _join, _leave, _llama, _token_ce, _tokens
from test_ranks_pipeline import _check, _spawn

import torchspan
from torchspan.runtime.ranks import free_port
from torchspan.runtime.ranks.stage import RankStage


def _step(bucketed: bool, schedule: str, rank: int) -> tuple[torchspan.Spanned, torch.Tensor, int]:
    RankStage.bucketed = bucketed
    spanned = torchspan.span(_llama(), devices=["cpu", "cpu"], microbatches=2, schedule=schedule)
    assert spanned.mode == "own-forward"
    ids, labels, mask = _batch(5, 6, 6, 40)
    rows = slice(0, 4) if rank // 2 == 0 else slice(4, 6)  # rank = replica * stages + stage
    inputs = {"input_ids": ids[rows], "attention_mask": mask[rows]}
    loss = spanned.train_step(inputs, labels[rows], _token_ce, loss_normalizer=_tokens)
    buckets = spanned._executor.ranks._buckets
    used = int(buckets.used.sum()) if buckets is not None and buckets.launched else 0
    return spanned, loss, used


def _worker(rank: int, world: int, port: int) -> None:
    _join(rank, world, port)
    RankStage.bucket_later_above = 0  # the later stage bucketed too, however small
    reference = _llama()
    ids, labels, mask = _batch(5, 6, 6, 40)
    expected = _token_ce(reference(ids, attention_mask=mask), labels)
    expected.backward()
    try:
        for schedule in ("1f1b", "gpipe", "zero-bubble", "merged-weights"):
            spanned, loss, used = _step(True, schedule, rank)
            flat, _, _ = _step(False, schedule, rank)
            bucketed = schedule != "merged-weights"
            assert (used > 0) == bucketed, f"{schedule}: rank {rank}: {used} parameter(s) bucketed"
            torch.testing.assert_close(loss.double(), expected.detach(), **LOSS_TOL)
            for (name, p), q in zip(spanned.module.named_parameters(), flat.module.parameters()):
                if p.device.type != "meta":
                    assert (p.grad is None) == (q.grad is None), f"{schedule}: {name}"
                    assert p.grad is None or torch.equal(p.grad, q.grad), f"{schedule}: rank {rank}: {name}"
            _check(spanned, reference, f"{schedule} bucketed", rank)
    finally:
        RankStage.bucketed, RankStage.bucket_later_above = True, 26 << 20
    _leave()


@pytest.mark.slow
def test_own_forward_pipeline_replicas_reduce_in_buckets_exactly() -> None:
    _spawn(_worker, 4, free_port(), deadline=300.0)
