"""The static audit (``torchspan.doctor``): every finding of issue 3, and the optional run."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console
from torch import nn

import torchspan
from torchspan.diagnosis import Finding, Report, doctor
from torchspan.diagnosis.audit import audit_state_dict


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def only(report: Report, code: str) -> Finding:
    found = [f for f in report.findings if f.code == code]
    assert len(found) == 1, report.format()
    return found[0]


def test_clean_setup_has_no_findings_and_runs() -> None:
    model = mlp()
    report = doctor(
        model,
        torch.randn(5, 3),
        target=torch.randint(0, 2, (5,)),
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )
    assert report.ok and report.findings == [] and report.ran and report.ops_checked > 5
    assert "no device problem" in report.format()


def test_model_split_groups_names_by_device() -> None:
    model = mlp()
    model[2].to("meta")
    f = only(doctor(model), "model-split")
    assert f.severity == "warning"
    assert "cpu: model.0.weight, model.0.bias" in f.details
    assert "meta: model.2.weight, model.2.bias" in f.details


def test_loss_weight_buffer_left_behind_is_an_error_naming_it() -> None:
    model = mlp().to("meta")
    crit = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 3.0]))
    target = torch.tensor([1, 0]).to("meta")
    report = doctor(model, target=target, loss_fn=crit)
    f = only(report, "loss-device")
    assert f.severity == "error" and "`loss_fn.weight`" in f.title and "loss_fn.to('meta')" in f.fix
    assert not report.ran  # no example inputs: nothing ran


def test_loss_buffer_without_target_compares_with_the_model_output() -> None:
    f = only(doctor(mlp().to("meta"), loss_fn=nn.NLLLoss(weight=torch.ones(2))), "loss-device")
    assert f.severity == "warning" and "last layer `model.2`" in f.title


def test_nested_batch_tensors_on_another_device_than_the_first_layer() -> None:
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 1)

        def forward(self, batch: dict, scale: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(batch["ids"]) * batch["extra"][0]) * scale

    model = TwoInputs().to("meta")
    batch = {"ids": torch.tensor([[1, 2]]), "extra": [torch.ones(1, 2, 4, device="meta")]}
    report = doctor(model, batch, torch.tensor(2.0), run=False)
    f = only(report, "batch-device")
    assert f.where == "args[0]['ids']" and "first layer `model.embed` (Embedding) is on meta" in f.title
    assert "to_device(batch, 'meta')" in f.fix  # the CPU scalar `scale` and the meta extra are fine


def test_target_on_another_device_than_the_output() -> None:
    f = only(doctor(mlp().to("meta"), target=torch.zeros(4, dtype=torch.long)), "target-device")
    assert "last layer `model.2`" in f.title and "target.to('meta')" in f.fix


def test_optimizer_state_on_another_device_than_its_parameter() -> None:
    model = mlp().to("meta")
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():  # a checkpoint's state loaded after the model moved
        opt.state[p] = {
            "step": torch.tensor(3.0),
            "exp_avg": torch.zeros(p.shape),
            "exp_avg_sq": torch.zeros(p.shape),
        }
    f = only(doctor(model, optimizer=opt), "optimizer-state-device")
    assert f.severity == "error"
    assert "optimizer.state[model.0.weight]['exp_avg'] on cpu, parameter on meta" in f.details[0]
    assert "'step'" not in f.details[0]  # a CPU step counter is legal
    assert "torchspan.to_device(optimizer, 'meta')" in f.fix


def test_optimizer_built_before_to_replaced_the_parameters() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.to("meta")  # cpu -> meta makes new Parameter objects; opt still holds the old ones
    f = only(doctor(model, optimizer=opt), "optimizer-stale-params")
    assert f.severity == "error" and "optimizer.param_groups[0] holds 4 tensor(s)" in f.title
    assert "in no param group: model.0.weight" in f.details[1]
    assert "optimizer = torch.optim.SGD(model.parameters(), ...)" in f.fix


def test_optimizer_with_parameters_of_another_module_is_only_a_warning() -> None:
    model, other = mlp(), nn.Linear(7, 7)
    opt = torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=0.1)
    assert only(doctor(model, optimizer=opt), "optimizer-stale-params").severity == "warning"


@pytest.mark.skipif(torch.cuda.is_available(), reason="DataParallel is inert only without CUDA")
def test_dataparallel_in_cpu_mode() -> None:
    model = nn.Sequential(nn.DataParallel(mlp()))
    f = only(doctor(model), "dataparallel-no-cuda")
    assert f.where == "model.0" and "model[0] = model[0].module" in f.fix


def test_dataparallel_parameters_not_on_device_ids0_named() -> None:
    dp = nn.DataParallel(mlp())
    dp.device_ids, dp.src_device_obj = [0], torch.device("meta")  # what CUDA machines set up; meta = cuda:0
    dp.module[2].to("meta")
    f = only(doctor(dp), "dataparallel-device")
    assert "`model.module.0.weight` is on cpu (and 1 more)" in f.title
    assert "model.module.to('meta')" in f.fix and "model = model.module" in f.fix


def test_state_dict_prefix_both_ways() -> None:
    model = mlp()
    saved = {f"module.{k}": v for k, v in model.state_dict().items()}
    f = only(doctor(model, state_dict=saved), "state-dict-prefix")
    assert (
        "'module.'" in f.title and "consume_prefix_in_state_dict_if_present(state_dict, 'module.')" in f.fix
    )
    wrapped = nn.DataParallel(mlp())
    g = [x for x in audit_state_dict(wrapped, model.state_dict()) if x.code == "state-dict-prefix"]
    assert len(g) == 1 and "model.module.load_state_dict(state_dict)" in g[0].fix
    compiled = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}
    assert "'_orig_mod.'" in only(doctor(model, state_dict=compiled), "state-dict-prefix").title
    assert doctor(model, state_dict=model.state_dict()).findings == []
    with pytest.raises(ValueError, match="state_dict=list"):
        doctor(model, state_dict=[1, 2])


def test_plain_tensor_attribute_left_behind() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.scale = torch.ones(2)

    f = only(doctor(Scaled().to("meta")), "tensor-attribute")
    assert f.where == "model.scale" and "register_buffer('scale'" in f.fix


def test_no_run_without_inputs_and_run_with_them() -> None:
    calls = []

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return self.fc(x)

    model = Counting()
    assert not doctor(model).ran and calls == []
    assert not doctor(model, torch.randn(1, 2), run=False).ran and calls == []
    assert doctor(model, torch.randn(1, 2)).ran and calls == [1]


def test_run_adds_the_watchers_error_and_restores_gradients_and_buffers() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model[2].to("meta")
    before = model[1].running_mean.clone()
    grad = torch.full_like(model[0].weight, 7.0)
    model[0].weight.grad = grad
    report = doctor(
        model, torch.randn(5, 3), target=torch.zeros(5, dtype=torch.long), loss_fn=nn.CrossEntropyLoss()
    )
    f = only(report, "device-mismatch")
    assert f.where == "model.2 (Linear)" and any(t.name == "model.2.weight" for t in f.tensors)
    assert report.ran and not report.ok
    assert model[0].weight.grad is grad
    assert torch.equal(model[1].running_mean, before)


def test_run_with_backward_catches_a_backward_error() -> None:
    class Hooked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)
            self.mask = torch.ones(2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            h.register_hook(lambda g: g * self.mask)
            return h

    model = Hooked().to("meta")
    x, y = torch.randn(4, 3, device="meta"), torch.zeros(4, dtype=torch.long, device="meta")
    assert doctor(model, x).ok  # forward alone is fine
    report = doctor(model, x, target=y, loss_fn=nn.CrossEntropyLoss())
    f = only(report, "device-mismatch")
    assert "during backward" in f.title and f.where == "backward of AddmmBackward0 in model.fc (Linear)"


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match=r"doctor\(model=\.\.\.\) got a str"):
        doctor("resnet")
    with pytest.raises(ValueError, match=r"doctor\(optimizer=\.\.\.\)"):
        doctor(mlp(), optimizer=object())
    with pytest.raises(ValueError, match=r"run=True\) needs example inputs"):
        doctor(mlp(), run=True)
    with pytest.raises(ValueError, match="severity"):
        Finding("x", "fatal", "t", "f")


def test_report_json_plain_and_rich() -> None:
    model = mlp().to("meta")
    target = torch.zeros(2, dtype=torch.long, device="meta")
    report = torchspan.doctor(
        model, torch.randn(2, 3), target=target, loss_fn=nn.CrossEntropyLoss(weight=torch.ones(2)), run=False
    )
    assert sorted(report.codes()) == ["batch-device", "loss-device"]
    data = json.loads(json.dumps(report.to_dict()))
    assert (
        data["ok"] is False
        and data["errors"] == 2
        and [f["code"] for f in data["findings"]] == report.codes()
    )
    assert report.format().startswith("torchspan doctor: 2 error(s), 0 warning(s)")
    buf = io.StringIO()
    report.render(Console(file=buf, width=120, force_terminal=False))
    text = buf.getvalue()
    assert "error: loss_fn buffer" in text and "fix" in text and "loss_fn.to('meta')" in text


# ---------------------------------------------------------------------- issue 10: advice that fixes the
# problem


class _VeryBigModule(nn.Module):
    """Seed 001's model: `nn.Parameter(t).cuda(1)` stores a plain tensor copy (here `.to("meta")`)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.GiantParameter2 = nn.Parameter(torch.randn(4, 4)).to("meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.GiantParameter2.mm(self.lin(x))


def test_parameter_moved_after_wrapping_is_not_told_to_become_a_buffer() -> None:
    model = _VeryBigModule()
    found = only(doctor(model), "unregistered-parameter")
    assert "not a parameter and will not be trained" in found.fix
    assert "nn.Parameter(t.to(device))" in found.fix and "register_buffer" not in found.fix
    with pytest.raises(torchspan.DeviceMismatchError) as exc, torchspan.watch():
        model(torch.randn(4, 4))
    text = str(exc.value)
    assert (
        "unregistered parameter" in text
        and "nn.Parameter(t.to(device))" in text
        and "register_buffer" not in text
    )


def test_plain_tensor_attribute_without_grad_still_gets_register_buffer() -> None:
    model = _VeryBigModule()
    model.GiantParameter2 = torch.randn(4, 4, device="meta")
    assert "register_buffer('GiantParameter2'" in only(doctor(model), "tensor-attribute").fix


def test_factory_with_an_explicit_device_is_not_said_to_lack_one() -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(torchspan.DeviceMismatchError) as exc, torchspan.watch():
        noise = torch.randn(2, 4, device="meta")
        model(noise)
    text = str(exc.value)
    assert "made by torch.randn with device='meta'" in text and "no device was given" not in text
    model.to("meta")
    with pytest.raises(torchspan.DeviceMismatchError) as exc, torchspan.watch():
        noise = torch.randn(2, 4)
        model(noise)
    assert "made by torch.randn on cpu because no device was given" in str(exc.value)


def test_target_without_loss_fn_warns_that_no_backward_runs() -> None:
    with pytest.warns(UserWarning, match=r"target=.*without loss_fn.*pass loss_fn="):
        doctor(mlp(), torch.randn(5, 3), target=torch.randint(0, 2, (5,)))
