"""A single worker's mailbox (issue 21: no lock when one worker runs): values handed within the worker
arrive, and a value asked for before anything put it raises instead of waiting forever (nobody else runs)."""

from __future__ import annotations

import pytest

from torchspan.runtime.local.worker import Mailbox, run_workers


def test_one_worker_hands_values_to_itself() -> None:
    seen: list[int] = []

    def job(box: Mailbox) -> None:
        box.put(("fwd", 1, 0), 7)
        seen.append(box.get(("fwd", 1, 0)))

    run_workers([job])
    assert seen == [7]


def test_one_worker_asking_for_a_value_nobody_put_raises_at_once() -> None:
    def job(box: Mailbox) -> None:
        box.get(("bwd", 0, 3))  # with two workers this would wait for the other; alone it never arrives

    with pytest.raises(RuntimeError, match=r"before any step put it there"):
        run_workers([job])
