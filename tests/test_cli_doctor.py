"""``torchspan doctor SCRIPT.py``: the seeds' device errors diagnosed from unmodified scripts."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from torchspan.cli import main
from torchspan.commands.doctor import EXIT_DEVICE_ERROR


def write(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


TOY = """
    import torch
    import torch.nn as nn
    import torch.optim as optim

    class ToyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.net1 = nn.Linear(10, 10)
            self.relu = nn.ReLU()
            self.net2 = nn.Linear(10, 5).to('meta')   # placed by hand on the other device

        def forward(self, x):
            x = self.relu(self.net1(x))
            return self.net2(x)

    model = ToyModel()
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(model.parameters(), lr=0.001)
    optimizer.zero_grad()
    outputs = model(torch.randn(20, 10))
    print("not reached")
"""

LOSS_WEIGHT = """
    import torch as t
    criterion = t.nn.CrossEntropyLoss(weight=t.Tensor([1, 3]))
    inp = t.randn(4, 2).to('meta')
    target = t.Tensor([1, 0, 0, 1]).long().to('meta')
    loss = criterion(inp, target)
"""

DATA_MODEL = """
    import torch, torch.nn as nn

    def main():
        model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1)).to('meta')
        data = torch.rand(8, 2)          # forgot data.to(device)
        return model(data)

    if __name__ == "__main__":
        main()
"""

DATAPARALLEL = """
    import torch, torch.nn as nn
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    model = nn.DataParallel(model)
    # what DataParallel sets up when GPUs are visible (meta stands for cuda:0)
    model.device_ids, model.output_device, model.src_device_obj = [0, 1], 0, torch.device('meta')
    out = model(torch.rand(4, 2))
"""

CLEAN = """
    import sys, torch, torch.nn as nn
    assert __name__ == "__main__"
    steps = int(sys.argv[1])
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    crit = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0]))
    opt = torch.optim.Adam(model.parameters())
    for step in range(steps):
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        loss = crit(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
    print("trained", steps, "steps with", sys.argv[1:])
"""


def test_layer_placed_by_hand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["doctor", write(tmp_path, "toy.py", TOY)])
    out = capsys.readouterr().out
    assert code == EXIT_DEVICE_ERROR
    assert "device error in toy.py" in out and "not reached" not in out
    assert "where: model.net2 (Linear)" in out
    assert "parameter model.net2.weight" in out
    assert "produced by torch.nn.functional.relu in model.relu (ReLU)" in out
    assert "fix: move the input with `x = x.to('meta')` before `model.net2`" in out
    assert "model has parameters and buffers on 2 devices" in out  # static context from the script's objects


def test_loss_weight_left_behind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["doctor", write(tmp_path, "loss.py", LOSS_WEIGHT)])
    out = capsys.readouterr().out
    assert code == EXIT_DEVICE_ERROR
    assert "where: criterion (CrossEntropyLoss)" in out
    assert "buffer criterion.weight" in out and "fix: call `criterion.to('meta')`" in out


def test_data_and_model_on_different_devices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["doctor", write(tmp_path, "data.py", DATA_MODEL)])
    out = capsys.readouterr().out
    assert code == EXIT_DEVICE_ERROR
    assert "where: model.0 (Linear)" in out and "parameter model.0.weight" in out
    assert "tensor data, created by torch.rand" in out and "data = data.to('meta')" in out


def test_dataparallel_cpu_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["doctor", write(tmp_path, "dp.py", DATAPARALLEL)])
    out = capsys.readouterr().out
    assert code == EXIT_DEVICE_ERROR
    assert "model.module.0.weight is on cpu" in out
    assert "model = model.module" in out


def test_clean_script_runs_to_the_end_with_its_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv_before = sys.argv[:]
    code = main(["doctor", write(tmp_path, "train.py", CLEAN), "--", "2", "--flag"])
    out = capsys.readouterr().out
    assert code == 0
    assert "trained 2 steps with ['2', '--flag']" in out
    assert "no device problem seen in train.py" in out and "forward and backward" in out
    assert sys.argv == argv_before


def test_json_report_keeps_stdout_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["doctor", "--json", write(tmp_path, "toy.py", TOY)])
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert (
        code == EXIT_DEVICE_ERROR
        and data["status"] == "device-error"
        and data["exit_code"] == EXIT_DEVICE_ERROR
    )
    first = data["report"]["findings"][0]
    assert first["code"] == "device-mismatch" and first["where"] == "model.net2 (Linear)"
    assert any(t["name"] == "model.net2.weight" for t in first["tensors"])
    ok = main(["doctor", "--json", write(tmp_path, "train.py", CLEAN), "1"])
    captured = capsys.readouterr()
    assert ok == 0 and json.loads(captured.out)["status"] == "ok"
    assert "trained 1 steps" in captured.err  # the script's prints go to stderr with --json


def test_script_failing_for_another_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = write(tmp_path, "bad.py", "import torch\nx = torch.randn(2, 3) @ torch.randn(2, 3)\n")
    code = main(["doctor", script])
    captured = capsys.readouterr()
    assert code == 1
    assert "not a device error" in captured.out
    assert "bad.py" in captured.err and "RuntimeError" in captured.err


def test_script_exit_status_passes_through(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", write(tmp_path, "exit.py", "import sys\nsys.exit(4)\n")]) == 4
    assert "exited with status 4" in capsys.readouterr().out
    assert main(["doctor", write(tmp_path, "exit0.py", "raise SystemExit(0)\n")]) == 0


def test_missing_script_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", str(tmp_path / "nope.py")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_terminal_output_uses_rich(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    code = main(["doctor", write(tmp_path, "loss.py", LOSS_WEIGHT)])
    out = capsys.readouterr().out
    assert code == EXIT_DEVICE_ERROR
    assert "╭" in out or "┌" in out  # a rich panel, not the plain layout
    assert "criterion.weight" in out and "criterion.to('meta')" in out


def test_unrelated_error_mentioning_a_device_is_not_called_a_device_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write(
        tmp_path,
        "disk.py",
        "raise RuntimeError('No space left on device while writing a device type table')\n",
    )
    code = main(["doctor", script])
    captured = capsys.readouterr()
    assert code == 1
    assert "not a device error" in captured.out and "No space left on device" in captured.err


STALE_OPTIMIZER = """
    import torch, torch.nn as nn
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.to_empty(device='meta')      # new Parameter objects: opt keeps updating the old ones
    model(torch.randn(3, 4, device='meta')).sum().backward()
    opt.step()
"""

TWO_MODELS = """
    import torch, torch.nn as nn
    gen, disc = nn.Linear(4, 4), nn.Linear(4, 4)
    frozen = nn.Linear(4, 4).requires_grad_(False)
    opt_g, opt_d = torch.optim.Adam(gen.parameters()), torch.optim.Adam(disc.parameters())
    both = torch.optim.SGD(list(gen.parameters()) + list(disc.parameters()), lr=0.1)
    disc(frozen(gen(torch.randn(2, 4)))).sum().backward()
    opt_g.step(); opt_d.step(); both.step()
"""

PREFIX = """
    import torch, torch.nn as nn
    sd = nn.DataParallel(nn.Linear(2, 3)).state_dict()
    fresh = nn.Linear(2, 3)
    {fix}fresh.load_state_dict(sd)
"""


def test_optimizer_holding_replaced_parameters_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["doctor", write(tmp_path, "stale.py", STALE_OPTIMIZER)])
    out = capsys.readouterr().out
    assert code == EXIT_DEVICE_ERROR and "ran to the end without a device error" in out
    assert "opt.param_groups[0] holds 2 tensor(s) that are not parameters of model" in out
    assert "model.weight, model.bias" in out
    assert (
        main(["doctor", write(tmp_path, "gan.py", TWO_MODELS)]) == 0
    )  # optimizers over other modules are fine
    assert "no device problem seen" in capsys.readouterr().out


def test_state_dict_prefix_named_with_a_fix_that_works(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["doctor", write(tmp_path, "load.py", PREFIX.format(fix=""))])
    out = capsys.readouterr().out
    assert code == 1 and "not a device error" in out
    assert "'module.' prefix" in out
    fix = "torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(sd, 'module.')"
    assert fix in out and "fresh.load_state_dict(sd)" in out
    assert main(["doctor", write(tmp_path, "fixed.py", PREFIX.format(fix=fix + "\n    "))]) == 0


def test_json_names_the_error_that_ended_the_script(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write(tmp_path, "bad.py", "def f():\n    raise ValueError('bad value 42')\nf()\n")
    assert main(["doctor", "--json", script]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["status"] == "script-error"
    assert data["error"] == {
        "type": "ValueError",
        "message": "bad value 42",
        "where": "bad.py:2: raise ValueError('bad value 42')",
    }
    assert main(["doctor", "--json", write(tmp_path, "ok.py", "x = 1\n")]) == 0
    assert json.loads(capsys.readouterr().out)["error"] is None


def test_script_ending_in_sys_exit_0_is_still_audited(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """The optimizer-before-.to() trap must be reported whether the script ends or calls sys.exit(0)."""
    script = tmp_path / "exits.py"
    script.write_text(
        "import sys, torch\n"
        "from torch import nn\n"
        "model = nn.Linear(4, 2)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "model.to_empty(device='meta')  # new parameters: the optimizer still holds the old ones\n"
        "sys.exit(0)\n"
    )
    from torchspan.cli import main

    code = main(["doctor", str(script)])
    out = capsys.readouterr().out
    assert code == 3, out
    assert "optimizer" in out
