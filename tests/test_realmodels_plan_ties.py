"""The plan records tied parameters (one Parameter held by several layers): their layers, stages and bytes,
named in the plan table, noted when the cut splits them, kept through JSON."""

from __future__ import annotations

import torch
from torch import nn

import torchspan


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight  # tied input/output embedding

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.head(h)


IDS = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))


def _model() -> TiedLM:
    torch.manual_seed(0)
    return TiedLM()


def test_split_tie_is_recorded_named_and_noted() -> None:
    model = _model()
    plan = torchspan.plan(  # 60 KiB each: no device holds the whole model (~85 KiB with its working memory)
        model,
        IDS,
        devices="a100-40gb*4",
        memory={f"cuda:{i}": "60KiB" for i in range(4)},
        optimizer="sgd",
        microbatches=2,
        schedule="gpipe",
        recompute="never",
    )
    assert len(plan.stages) >= 2
    (tie,) = plan.ties
    assert tie["name"] == "embed.weight" and tie["layers"] == ["embed", "head"]
    assert tie["stages"] == [0, len(plan.stages) - 1] and tie["bytes"] == 64 * 32 * 4
    text = str(plan)
    assert (
        f"tie: embed.weight (8.00 KiB) shared by embed (stage 0), head (stage {len(plan.stages) - 1}): split"
        in text
    )
    assert any("tied parameter embed.weight is used on stages" in n for n in plan.notes)
    again = torchspan.Plan.from_json(plan.to_json())
    assert again.ties == plan.ties
    spanned = torchspan.span(model, plan=_on_cpu(again))
    assert spanned.stages[0][1][0] == "embed"


def test_tie_on_one_stage_is_recorded_without_a_note() -> None:
    plan = torchspan.plan(
        _model(), IDS, devices="cpu", optimizer="sgd", microbatches=1, schedule="gpipe", recompute="never"
    )
    assert plan.ties == [{"name": "embed.weight", "layers": ["embed", "head"], "stages": [0], "bytes": 8192}]
    assert "split" not in str(plan) and not any("tied parameter" in n for n in plan.notes)


def test_plan_without_ties_keeps_its_json() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    plan = torchspan.plan(model, torch.randn(4, 4), devices="cpu", optimizer="sgd", microbatches=1)
    assert plan.ties == [] and "ties" not in plan.to_dict()


def _on_cpu(plan: torchspan.Plan) -> torchspan.Plan:
    data = plan.to_dict()
    for st in data["stages"]:
        st["device"], st["device_name"] = "cpu", ""
    return torchspan.Plan.from_dict(data)
