"""``torchspan verify --strategies single,fsdp --nproc-per-node 2``: sharded data parallel against one device
(issue 20, item 7).

``fsdp`` runs ``span(model, shard=True)`` in gloo processes on 127.0.0.1 and every rank writes the full
gradients (``.grad.full_tensor()``); ``fsdp-offload`` needs a GPU per process and is refused before
anything runs where there is none (exit status 2, one line).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from torchspan.cli import main
from torchspan.parity_ranks import processes_for

MODELS = textwrap.dedent(
    """
    import torch
    from torch import nn

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 5))
    """
)


@pytest.fixture()
def models(tmp_path: Path) -> str:
    path = tmp_path / "models.py"
    path.write_text(MODELS)
    return str(path)


@pytest.mark.slow
def test_verify_fsdp_passes_against_one_device(models: str, capsys: pytest.CaptureFixture[str]) -> None:
    # 7 rows over 2 processes (4 + 3); Linear(16, 5): 5 rows of weights sharded 3 + 2
    code = main(
        [
            "verify",
            f"{models}:mlp",
            "--input-shape",
            "7,16",
            "--strategies",
            "single,fsdp",
            "--nproc-per-node",
            "2",
            "--json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    fsdp = next(s for s in report["strategies"] if s["name"] == "fsdp")
    assert fsdp["verdict"] == "PASS" and fsdp["processes"] == 2 and fsdp["error"] is None, fsdp
    assert len(fsdp["parameters"]) == 6 and fsdp["same_loss"]


def test_verify_fsdp_needs_two_processes(models: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "verify",
            f"{models}:mlp",
            "--input-shape",
            "7,16",
            "--strategies",
            "single,fsdp",
            "--nproc-per-node",
            "1",
        ]
    )
    assert code == 2
    assert (
        "sharded data parallel (parameters, gradients and optimizer state split over the processes) needs "
        "at least 2" in capsys.readouterr().err
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: fsdp-offload runs there")
def test_verify_fsdp_offload_is_refused_without_a_gpu(
    models: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "verify",
            f"{models}:mlp",
            "--input-shape",
            "7,16",
            "--strategies",
            "single,fsdp-offload",
            "--nproc-per-node",
            "2",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "fsdp-offload needs a GPU" in err and "compare fsdp instead" in err
    with pytest.raises(ValueError, match="fsdp-offload needs a GPU"):
        processes_for(["fsdp-offload"], 1)
    assert processes_for(["fsdp", "dp"], 3) == {"fsdp": 3, "dp": 3}


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="fsdp-offload computes on a GPU (one per process); this machine has none",
)
def test_verify_fsdp_offload_on_a_gpu(models: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "verify",
            f"{models}:mlp",
            "--input-shape",
            "7,16",
            "--strategies",
            "single,fsdp-offload",
            "--nproc-per-node",
            "1",
            "--json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
