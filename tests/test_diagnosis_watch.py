"""The device watcher: forward and backward mismatches named with module, parameter, producer and fix.

CPU-only: the ``meta`` device stands for a second, genuinely different device.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchspan
from torchspan.diagnosis import DeviceMismatchError, watch
from torchspan.diagnosis.watcher import active_watcher


class ToyModel(nn.Module):
    """The seed's model-parallel toy with net2 placed by hand on the other device."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5).to("meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.net1(x))
        return self.net2(x)  # forgot x.to('meta')


def test_layer_placed_by_hand_names_module_parameter_producer_and_fix() -> None:
    model = ToyModel()
    with pytest.raises(DeviceMismatchError) as info:
        with watch():
            model(torch.randn(20, 10))
    err = info.value
    msg = str(err)
    assert err.op == "torch.nn.functional.linear"
    assert err.phase == "forward"
    assert err.module == "model.net2 (Linear)"
    assert "parameter model.net2.weight" in msg and "parameter model.net2.bias" in msg
    assert "produced by torch.nn.functional.relu in model.relu (ReLU)" in msg
    assert "(20, 10) float32" in msg and "(5, 10) float32" in msg
    assert "x = x.to('meta')" in err.fix and "`model.net2`" in err.fix
    assert "return self.net2(x)" in msg  # the user's line
    odd = [t for t in err.tensors if t.odd]
    assert [t.label for t in odd] == ["input"] and odd[0].device == "cpu"
    assert isinstance(err, RuntimeError)
    assert isinstance(err.__cause__, RuntimeError) and "expected device" in str(err.__cause__)


def test_loss_weight_buffer_left_on_cpu() -> None:
    criterion = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 3.0]))
    inp = torch.randn(4, 2, device="meta")
    target = torch.tensor([1, 0, 0, 1]).to("meta")
    with pytest.raises(DeviceMismatchError) as info:
        with watch():
            criterion(inp, target)
    err = info.value
    assert err.module == "criterion (CrossEntropyLoss)"
    assert err.op == "torch.nn.functional.cross_entropy"
    weight = next(t for t in err.tensors if t.label == "weight")
    assert weight.odd and weight.kind == "buffer" and weight.name == "criterion.weight"
    assert {t.name for t in err.tensors if not t.odd} == {"inp", "target"}
    assert "criterion.to('meta')" in err.fix
    assert err.__cause__ is not None


def test_data_and_model_on_different_devices_uses_given_names() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).to("meta")
    batch = torch.randn(5, 3)
    with pytest.raises(DeviceMismatchError) as info:
        with watch(model=net):
            net(batch)
    err = info.value
    assert err.module == "model.0 (Linear)"
    assert "model.0.weight" in str(err)
    inp = next(t for t in err.tensors if t.odd)
    assert inp.name == "batch" and inp.kind == "variable"
    assert "batch = batch.to('meta')" in err.fix and "model[0]" in err.fix


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def test_nested_model_paths() -> None:
    model = Net()
    model.encoder.layers[2].to("meta")
    with pytest.raises(DeviceMismatchError) as info:
        with watch():
            model(torch.randn(3, 4))
    err = info.value
    assert err.module == "model.encoder.layers.2 (Linear)"
    assert "parameter model.encoder.layers.2.weight" in str(err)
    assert "produced by torch.tanh in model.encoder.layers.1 (Tanh)" in str(err)
    assert "model.encoder.layers[2]" in err.fix


def test_silent_meta_mix_is_caught_without_pytorch_error() -> None:
    a = torch.randn(2, 3)
    b = torch.randn(3, 2, device="meta")
    assert (a @ b).device.type == "cpu"  # PyTorch itself lets this through on meta
    with pytest.raises(DeviceMismatchError) as info:
        with watch():
            a @ b
    assert info.value.__cause__ is None
    assert "did not refuse" in info.value.fix


def test_cpu_scalars_and_python_numbers_are_legal() -> None:
    x = torch.randn(3, device="meta")
    with watch() as w:
        y = x * torch.tensor(2.0) + 1.5
        z = torch.where(x > 0, x, torch.tensor(0.0))
    assert y.device.type == "meta" and z.device.type == "meta"
    assert w.ops >= 3


def test_clean_training_loop_passes_and_counts() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    crit = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0]))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    idx = torch.tensor([0, 2])
    with watch() as w:
        for _ in range(2):
            out = model(x)
            loss = crit(out[idx], y[idx]) + out.pow(2).mean() * 0.01
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    assert w.ops > 20 and w.modules_run == 2 * 5  # Sequential + 3 layers + loss, twice
    assert active_watcher() is None


def test_watcher_is_removed_after_the_block() -> None:
    with watch():
        pass
    with pytest.raises(RuntimeError) as info:
        torch.randn(2, device="meta") + torch.randn(2)
    assert not isinstance(info.value, DeviceMismatchError)


def test_nested_watch_reuses_the_outer_watcher() -> None:
    model = nn.Linear(2, 2).to("meta")
    with pytest.raises(DeviceMismatchError) as info:
        with watch() as outer:
            with watch(net=model) as inner:
                assert active_watcher() is outer
                model(torch.randn(1, 2))
    assert inner._outer is outer
    assert info.value.module == "net (Linear)"


def test_watch_rejects_non_objects() -> None:
    with pytest.raises(ValueError, match=r"watch\(model=\.\.\.\) got a int"):
        watch(model=3)


# ---------------------------------------------------------------------- backward


class Clip(torch.autograd.Function):
    """Gradient clipping whose backward builds its limit without a device (a classic slip)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        limit = torch.full((g.shape[-1],), 1.0)
        return torch.minimum(g, limit)


class ClipGrad(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Clip.apply(x)


def test_backward_custom_function_names_node_module_and_fix() -> None:
    model = nn.Sequential(nn.Linear(3, 4), ClipGrad(), nn.Linear(4, 2)).to("meta")
    out = None
    with pytest.raises(DeviceMismatchError) as info:
        with watch():
            out = model(torch.randn(5, 3, device="meta"))
            out.sum().backward()
    err = info.value
    assert out is not None  # forward passed: the problem is in backward only
    assert err.phase == "backward"
    assert err.module == "backward of ClipBackward in model.1 (ClipGrad)"
    assert err.op == "aten.minimum.default"
    limit = next(t for t in err.tensors if t.odd)
    assert limit.name == "limit" and limit.device == "cpu" and "created by torch.full" in (limit.origin or "")
    assert "device=g.device" in err.fix
    assert "Clip.backward" in str(err.location)
    assert err.__cause__ is not None


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.mask = torch.ones(4)  # plain attribute, so .to() leaves it behind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.register_hook(lambda g: g * self.mask)
        return h


def test_backward_tensor_hook_with_stale_attribute() -> None:
    model = nn.Sequential(nn.Linear(3, 4), Gated()).to("meta")
    with pytest.raises(DeviceMismatchError) as info:
        with watch():
            model(torch.randn(2, 3, device="meta")).sum().backward()
    err = info.value
    assert err.phase == "backward"
    assert err.module == "backward of AddmmBackward0 in model.1.fc (Linear)"
    mask = next(t for t in err.tensors if t.odd)
    assert mask.kind == "attribute" and mask.name == "model.1.mask"
    assert "register_buffer('mask'" in err.fix


class WrongGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * 2

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.ones(g.shape).expand_as(g) * 2  # built on the CPU, returned as is


def test_backward_gradient_returned_on_wrong_device() -> None:
    class Layer(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return WrongGrad.apply(x)

    model = nn.Sequential(nn.Linear(3, 4), Layer()).to("meta")
    with pytest.raises(DeviceMismatchError) as info:
        with watch():
            model(torch.randn(2, 3, device="meta")).sum().backward()
    err = info.value
    assert err.code == "backward-gradient-device"
    assert err.module == "backward of WrongGradBackward in model.1 (Layer)"
    assert "WrongGrad.backward" in err.fix
    assert "invalid gradient" in str(err.__cause__)


def test_optimizer_state_left_on_other_device() -> None:
    model = nn.Linear(3, 2).to("meta")
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
        opt.state[p] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.zeros(p.shape),
            "exp_avg_sq": torch.zeros(p.shape),
        }
    with pytest.raises(DeviceMismatchError) as info:
        with watch():
            opt.step()
    err = info.value
    assert err.phase == "optimizer step" and err.module == "opt.step() (Adam)"
    state = next(t for t in err.tensors if t.odd)
    assert state.kind == "optimizer state" and state.name == "opt.state[model.weight]['exp_avg']"
    assert "torchspan.to_device(opt, 'meta')" in err.fix


def test_dataparallel_with_parameters_off_device_ids0() -> None:
    model = nn.DataParallel(nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1)))
    # What DataParallel sets up when GPUs are visible; 'meta' stands for cuda:0.
    model.device_ids, model.output_device, model.src_device_obj = [0, 1], 0, torch.device("meta")
    with pytest.raises(DeviceMismatchError) as info:
        with watch():
            model(torch.rand(4, 2))
    err = info.value
    assert err.code == "dataparallel-device"
    assert "model.module.0.weight is on cpu" in str(err)
    assert "model = model.module" in err.fix and "model.module.to('meta')" in err.fix


@pytest.mark.skipif(torch.cuda.is_available(), reason="DataParallel is inert only without CUDA")
def test_dataparallel_without_cuda_is_a_warning() -> None:
    model = nn.DataParallel(nn.Linear(2, 1))
    with watch() as w:
        model(torch.rand(3, 2))
        model(torch.rand(3, 2))
    assert [f.code for f in w.findings] == ["dataparallel-no-cuda"]
    assert "model = model.module" in w.findings[0].fix


def test_top_level_export() -> None:
    assert torchspan.watch is watch and torchspan.DeviceMismatchError is DeviceMismatchError


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_cuda_mismatch_and_legal_mixes() -> None:
    crit = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 3.0]))
    x = torch.randn(4, 2, device="cuda")
    y = torch.tensor([1, 0, 0, 1], device="cuda")
    with pytest.raises(DeviceMismatchError) as info:
        with watch():
            crit(x, y)
    assert "criterion.to('cuda:0')" in info.value.fix
    assert info.value.__cause__ is not None
    seq = torch.randn(3, 5, 2, device="cuda")
    with watch():
        x * torch.tensor(2.0)  # CPU scalar: legal
        x[torch.tensor([0, 1])]  # CPU index: legal
        nn.utils.rnn.pack_padded_sequence(
            seq, torch.tensor([5, 4, 2]), batch_first=True
        )  # CPU lengths: legal


def test_producers_are_kept_beside_tensors_not_on_them(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchspan.diagnosis.watcher as watch_module

    monkeypatch.setattr(watch_module, "_PRUNE_AT", 10)  # prune often, and keep pruning after the first time
    model = nn.Linear(2, 2)
    with watch() as w:
        out = model(torch.randn(1, 2))
        for _ in range(50):
            torch.randn(3) * 2  # short-lived tensors: their entries get pruned
    assert vars(out) == {}  # nothing pickled or deep-copied along with the output
    op, module = w.producer(out)
    assert module is model and op is torch.nn.functional.linear
    assert len(w._src) <= 20
    assert w.producer(torch.randn(1)) is None


def test_compiled_module_is_watched_eagerly_and_named() -> None:
    # dynamo would trace the watcher into its graph and let PyTorch's bare error escape
    model = torch.compile(ToyModel(), backend="eager")
    with pytest.raises(DeviceMismatchError) as info:
        with watch(model=model):
            model(torch.randn(2, 10))
    assert info.value.module is not None and info.value.module.endswith("net2 (Linear)")
    assert "model._orig_mod.net2.weight" in str(info.value)
    clean = torch.compile(nn.Linear(3, 2), backend="eager")
    with watch():
        clean(torch.randn(2, 3)).sum().backward()
    assert torch.compiler.is_compiling() is False


def _resume(move_model_first: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Resume from a checkpoint; `.to()` keeps the Parameter objects, as it does for CPU -> CUDA."""
    old = nn.Linear(3, 2)
    opt = torch.optim.Adam(old.parameters())
    old(torch.randn(2, 3)).sum().backward()
    opt.step()
    ckpt = opt.state_dict()
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        if move_model_first:
            model.to("meta")
        opt.load_state_dict(ckpt)
        model.to("meta")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    model(torch.randn(2, 3, device="meta")).sum().backward()
    return model, opt


def test_optimizer_state_fix_works_when_applied() -> None:
    model, opt = _resume(move_model_first=False)
    with pytest.raises(DeviceMismatchError) as info:
        with watch(model=model, opt=opt):
            opt.step()
    fix = info.value.fix
    assert "map_location" not in fix  # load_state_dict casts to the parameter's device anyway: no help
    assert "torchspan.to_device(opt, 'meta')" in fix and "before `opt.load_state_dict(...)`" in fix
    model, opt = _resume(move_model_first=True)  # the second fix
    with watch():
        opt.step()
    model, opt = _resume(move_model_first=False)  # the first fix
    torchspan.to_device(opt, "meta")
    with watch():
        opt.step()
