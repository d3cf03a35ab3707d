"""``torchspan.profile``: exact byte figures, saved activations, FLOPs, measured and estimated times."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchspan
from torchspan.layers import execution_order
from torchspan.profiler import LayerCost, Profile, measure, optimizer_state_bytes, timing

FAST = {"warmup": 1, "repeats": 2}
F32 = 4


def real_state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Optimizer state bytes after a real step: the reference the profiler must match."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


# ----------------------------------------------------------------------------- bytes


def test_linear_layernorm_conv_bytes_with_adam_are_exact() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 5 * 5, 6), nn.LayerNorm(6)
    )
    prof = torchspan.profile(model, torch.randn(2, 3, 5, 5), "a100-40gb", optimizer="adam")
    conv, flat, lin, norm = prof.layers
    assert conv.param_bytes == (4 * 3 * 3 * 3 + 4) * F32
    assert lin.param_bytes == (100 * 6 + 6) * F32
    assert norm.param_bytes == (6 + 6) * F32
    assert flat.param_bytes == flat.grad_bytes == flat.optimizer_bytes == 0
    for lay, n_tensors in ((conv, 2), (lin, 2), (norm, 2)):
        assert lay.grad_bytes == lay.param_bytes
        # exp_avg + exp_avg_sq per parameter, plus Adam's float32 `step` scalar per tensor
        assert lay.optimizer_bytes == 2 * lay.param_bytes + n_tensors * 4
    reference = real_state_bytes(model, torch.optim.Adam(model.parameters()))
    assert sum(lay.optimizer_bytes for lay in prof.layers) == reference


@pytest.mark.parametrize(
    ("optimizer", "factory"),
    [
        ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1)),
        ("sgd-momentum", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
        ("adamw", lambda ps: torch.optim.AdamW(ps)),
        ("rmsprop", lambda ps: torch.optim.RMSprop(ps)),
        ("adagrad", lambda ps: torch.optim.Adagrad(ps)),
        (torch.optim.ASGD, lambda ps: torch.optim.ASGD(ps)),  # its step needs .item(): sized from its state
    ],
)
def test_optimizer_state_matches_a_real_step(optimizer: object, factory: object) -> None:
    model = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7))
    expected = real_state_bytes(model, factory(model.parameters()))  # type: ignore[operator]
    assert optimizer_state_bytes(list(model.parameters()), optimizer) == expected
    if isinstance(optimizer, str) and optimizer.startswith("sgd"):
        assert expected == (0 if optimizer == "sgd" else sum(p.numel() * 4 for p in model.parameters()))


def test_optimizer_instance_uses_its_groups_and_skips_foreign_or_frozen_params() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(2, 2))
    model[2].weight.requires_grad_(False)
    opt = torch.optim.SGD(
        [
            {"params": model[0].parameters(), "momentum": 0.9},
            {"params": model[2].parameters(), "momentum": 0.0},
        ],
        lr=0.1,
    )
    prof = torchspan.profile(model, torch.randn(3, 4), "t4", optimizer=opt)
    assert prof.layers[0].optimizer_bytes == model[0].weight.numel() * 4 + 4 * 4  # momentum buffers
    assert prof.layers[1].optimizer_bytes == 0  # not in the optimizer
    assert prof.layers[2].optimizer_bytes == 0  # no momentum; frozen weight
    assert prof.layers[2].grad_bytes == 2 * 4  # bias only
    assert prof.layers[2].param_bytes == (4 + 2) * 4


def test_buffers_shared_parameters_and_dtype() -> None:
    bn = nn.BatchNorm1d(8)
    model = nn.Sequential(nn.Linear(8, 8), bn)
    prof = torchspan.profile(model, torch.randn(4, 8), "l4", optimizer="sgd")
    assert prof.layers[1].buffer_bytes == 8 * 4 * 2 + 8  # running mean/var + int64 counter
    half = torchspan.profile(model, torch.randn(4, 8), "l4", optimizer="adam", dtype=torch.bfloat16)
    assert half.dtype == "bfloat16"
    assert half.layers[0].param_bytes == prof.layers[0].param_bytes // 2
    assert half.layers[1].buffer_bytes == 8 * 2 * 2 + 8  # the int64 counter is not cast
    assert (prof.input_bytes, half.input_bytes) == (8 * 4, 8 * 2)  # the float32 batch is profiled as cast
    tied = nn.Linear(8, 8)
    shared = nn.Sequential(tied, nn.ReLU(), tied)  # one module at two entries: two layers, tied (issue 18)
    prof2 = torchspan.profile(shared, torch.randn(4, 8), "l4")
    assert [lay.param_bytes for lay in prof2.layers] == [(64 + 8) * 4, 0, 0]
    assert [lay.calls for lay in prof2.layers] == [1, 1, 1]
    assert prof2.layers[0].flops == prof2.layers[2].flops == 2 * 8 * 8


def test_parameters_shared_between_layers_are_counted_once() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.out(self.embed(ids))

    prof = torchspan.profile(Tied(), torch.randint(0, 10, (3, 2)), "l4", optimizer="sgd-momentum")
    assert prof.layer("embed").param_bytes == 40 * 4 and prof.layer("out").param_bytes == 0
    assert prof.layer("out").optimizer_bytes == 0 and prof.layer("embed").optimizer_bytes == 40 * 4


# ----------------------------------------------------------------------------- activations


def test_saved_activation_bytes_match_a_hand_count() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Tanh())
    prof = torchspan.profile(model, torch.randn(5, 8), "a100-40gb")
    lin1, relu, lin2, tanh = prof.layers
    # Linear saves its input (for the weight gradient), never its weight (that is a parameter).
    assert lin1.activation_bytes == 8 * F32
    # ReLU saves its output; the next Linear saves the same tensor: counted once, in ReLU ...
    assert relu.activation_bytes == 16 * F32
    assert lin2.activation_bytes == 0
    # ... and reported as shared, for a stage that starts at lin2 on another device.
    assert lin2.shared_activation_bytes == 16 * F32
    assert tanh.activation_bytes == 4 * F32  # tanh saves its output
    assert [lay.output_bytes for lay in prof.layers] == [16 * F32, 16 * F32, 4 * F32, 4 * F32]
    assert all(lay.activation_fixed_bytes == 0 for lay in prof.layers)
    assert prof.input_bytes == 8 * F32


def test_activation_bytes_are_per_sample_and_linear_in_batch() -> None:
    model = nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.LayerNorm(10), nn.Linear(10, 3))
    small = torchspan.profile(model, torch.randn(4, 6), "h100")
    large = torchspan.profile(model, torch.randn(12, 6), "h100")
    for a, b in zip(small.layers, large.layers):
        assert a.activation_bytes == b.activation_bytes
        assert a.output_bytes == b.output_bytes
        assert a.flops == b.flops
        assert a.saved_bytes(12) == pytest.approx(b.saved_bytes(12))
    assert not [n for n in small.notes if "not linear" in n]


def test_batch_independent_saved_tensors_are_a_fixed_part() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    prof = torchspan.profile(model, torch.randn(6, 8), "t4")
    bn = prof.layers[1]
    assert bn.activation_bytes == 8 * F32  # its input, per sample
    assert bn.activation_fixed_bytes == 2 * 8 * F32  # batch mean and inverse std, per call


def test_sizing_needs_no_real_memory() -> None:
    with torch.device("meta"):
        big = nn.Sequential(nn.Linear(8192, 8192), nn.ReLU(), nn.Linear(8192, 8192))
    prof = torchspan.profile(big, torch.randn(4096, 8192, device="meta"), "h100-80gb")
    assert prof.layers[0].param_bytes == (8192 * 8192 + 8192) * F32
    assert prof.layers[1].activation_bytes == 8192 * F32
    assert prof.layers[0].time_source[0].startswith("estimated")


# ----------------------------------------------------------------------------- FLOPs and estimates


def test_flops_and_estimates_scale_with_work() -> None:
    model = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 4096))
    prof = torchspan.profile(model, torch.randn(1024, 2048, device="meta"), "a100-40gb")
    first, second = prof.layers
    assert first.flops == 2 * 2048 * 2048
    assert second.flops == 2 * 2048 * 4096
    assert first.backward_flops == first.flops  # weight gradient only: the model input needs none
    assert second.backward_flops == 2 * second.flops  # weight and input gradients
    t1 = first.forward_seconds(0, 1024)
    t2 = second.forward_seconds(0, 1024)
    assert t2 / t1 == pytest.approx(2.0, rel=0.05)
    # compute-bound: FLOPs over the FP32 peak times the stated efficiency
    assert t2 == pytest.approx(1024 * second.flops / (19.5e12 * 0.6), rel=0.05)
    assert second.backward_seconds(0, 1024) == pytest.approx(2 * t2, rel=0.05)


def test_faster_device_gets_shorter_estimates_and_bf16_uses_tensor_cores() -> None:
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU())
    x = torch.randn(512, 1024, device="meta")
    prof = torchspan.profile(model, x, "t4,a100-40gb,h100-80gb")
    times = [prof.layers[0].forward_seconds(i, 512) for i in range(3)]
    assert times[0] > times[1] > times[2]
    bf16 = torchspan.profile(model, x, "a100-40gb", dtype="bfloat16")
    assert bf16.layers[0].forward_seconds(0, 512) < times[1] / 4
    assert "BF16" in bf16.layers[0].time_source[0]


def test_memory_bound_layers_are_estimated_from_traffic() -> None:
    model = nn.Sequential(nn.ReLU())
    prof = torchspan.profile(model, torch.randn(4096, 4096, device="meta"), "t4")
    relu = prof.layers[0]
    assert relu.flops == 0
    moved = 2 * 4096 * 4096 * F32  # read and write once
    assert relu.forward_seconds(0, 4096) == pytest.approx(moved / (320e9 * 0.8), rel=0.05)


# ----------------------------------------------------------------------------- measured times


def test_duplicate_present_devices_are_measured_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = measure._measure

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(str(args[7]))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(measure, "_measure", counting)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    prof = torchspan.profile(model, torch.randn(8, 16), ["cpu", "cpu"], **FAST)
    assert calls == ["cpu"]
    for lay in prof.layers:
        assert lay.time_source == ["measured", "measured"]
        assert lay.forward_fixed[0] == lay.forward_fixed[1]
        assert lay.backward_per_sample[0] == lay.backward_per_sample[1]
        assert lay.forward_seconds(0, 8) > 0
    assert prof.layers[0].backward_seconds(0, 8) > 0
    assert "cpu" in prof.calibration and prof.calibration["cpu"] > 0
    assert prof.devices[0].peak_flops and prof.devices[0].extra["speed_source"].startswith("measured")


def test_present_gpus_of_one_model_are_measured_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda:0 and cuda:1 of one model share times (noise would make them distinct types to the planner)."""
    calls: list[str] = []

    def fake(model, layers_of, args, batch, small, order, base, dev, *rest, **kw):  # type: ignore[no-untyped-def]
        calls.append(str(dev))
        k = 1.0 + len(calls)  # a different figure per measurement
        return {name: (k * 1e-5, k * 1e-6, k * 2e-5, k * 2e-6) for name in order}

    monkeypatch.setattr(measure, "_measure", fake)
    gpus = [torchspan.Device(torch.device("cuda", i), "NVIDIA L4", total_memory=24 * 2**30) for i in range(2)]
    other = torchspan.Device(torch.device("cuda", 2), "NVIDIA T4", total_memory=16 * 2**30)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    prof = torchspan.profile(model, torch.randn(8, 16), [*gpus, other], **FAST)
    assert calls == ["cuda:0", "cuda:2"]
    for lay in prof.layers:
        assert lay.time_source == ["measured"] * 3
        assert lay.forward_fixed[0] == lay.forward_fixed[1] != lay.forward_fixed[2]
        assert lay.backward_per_sample[0] == lay.backward_per_sample[1] != lay.backward_per_sample[2]
    assert any("cuda:1 (NVIDIA L4) takes the times measured on cuda:0" in n for n in prof.notes), prof.notes


def test_mixed_described_and_present_devices() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
    prof = torchspan.profile(model, torch.randn(8, 16), "a100-40gb*2,cpu", **FAST)
    assert [str(d) for d in prof.devices] == ["cuda:0", "cuda:1", "cpu"]
    for lay in prof.layers:
        assert lay.time_source[0].startswith("estimated: FP32 dense 19.5 TFLOP/s")
        assert lay.time_source[2] == "measured"
        assert len(lay.forward_fixed) == len(lay.backward_per_sample) == 3
    assert "estimated" in str(prof) and "measured" in str(prof)


def test_measure_false_estimates_the_cpu_from_its_measured_speed() -> None:
    model = nn.Sequential(nn.Linear(16, 16))
    prof = torchspan.profile(model, torch.randn(8, 16), "cpu", measure=False)
    assert prof.layers[0].time_source[0].startswith("estimated: FP32 matmul, measured")
    assert prof.layers[0].forward_seconds(0, 8) > 0


def test_profiling_leaves_the_model_as_it_was() -> None:
    model = nn.Sequential(
        nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), nn.ReLU(inplace=True), nn.Linear(6, 2)
    )
    model[0].weight.grad = torch.full_like(model[0].weight, 3.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 6)
    x_before = x.clone()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    torchspan.profile(model, x, "cpu", **FAST)
    assert torch.equal(torch.rand(3), expected)  # RNG state untouched
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(model[0].weight.grad, torch.full_like(model[0].weight, 3.0))
    assert model[4].weight.grad is None
    assert torch.equal(x, x_before)


def test_any_model_with_tuple_inputs_uses_execution_order() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(8, 3)  # registered first, runs last
            self.embed = nn.Embedding(50, 8)
            self.mix = nn.Linear(8, 8)

        def forward(self, ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            h = self.embed(ids)
            h = h + self.mix(h)  # glue in the parent forward
            return self.head(h.mean(1) * scale)

    model = Net()
    ids = torch.randint(0, 50, (4, 5))
    prof = torchspan.profile(model, (ids, 2.0), "cpu", **FAST)
    assert prof.names == execution_order(model, ids, 2.0) == ["embed", "mix", "head"]
    assert prof.layer("embed").activation_bytes == 5 * 8  # the int64 indices, for the embedding gradient
    assert prof.input_bytes == 5 * 8
    assert prof.layer("head").calls == 1
    with pytest.raises(KeyError, match="embed, mix, head"):
        prof.layer("nope")


# ----------------------------------------------------------------------------- helpers and errors


def test_fit_of_two_timing_points() -> None:
    assert timing.fit({4: 3.0, 16: 6.0}) == (pytest.approx(2.0), pytest.approx(0.25))
    assert timing.fit({4: 5.0, 16: 4.0}) == (4.0, 0.0)  # larger batch faster: noise, keep it fixed
    assert timing.fit({4: 1.0, 16: 8.0}) == (0.0, 0.5)  # negative intercept: through the origin
    assert timing.fit({1: 2.0}) == (0.0, 2.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"optimizer": "adamm"}, "optimizer='adamm' is not known"),
        ({"optimizer": 3}, "is not an optimizer"),
        ({"repeats": 0}, "repeats=0"),
        ({"dtype": "float33"}, "dtype='float33'"),
        ({"dtype": "int64"}, "dtype='int64' is not a floating dtype"),
        ({"devices": "b200"}, "unknown device 'b200'"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        torchspan.profile(nn.Sequential(nn.Linear(2, 2)), torch.randn(2, 2), **{"devices": "t4", **kwargs})  # type: ignore[arg-type]


def test_inputs_without_a_batch_and_non_modules_are_rejected() -> None:
    with pytest.raises(ValueError, match="no tensor with a batch dimension"):
        torchspan.profile(nn.Sequential(nn.Linear(2, 2)), (3.0,), "t4")
    with pytest.raises(ValueError, match="not an nn.Module"):
        torchspan.profile(lambda x: x, torch.randn(2, 2), "t4")  # type: ignore[arg-type]


def test_data_dependent_models_get_a_clear_error() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            return y if bool(y.sum() > 0) else -y

    with pytest.raises(ValueError, match="data-dependent"):
        torchspan.profile(Branchy(), torch.randn(2, 4), "t4")


def test_hand_built_layer_costs_keep_working() -> None:
    lay = LayerCost("a", "Linear", 10, 10, 20, 0, 4.0, 4.0, 8.0, [0.1], [0.01], [0.2], [0.02], ["measured"])
    prof = Profile([lay], torchspan.devices("cpu"), batch_size=4, input_bytes=4.0, optimizer="adam")
    assert lay.state_bytes == 40 and lay.saved_bytes(3) == 12.0
    assert prof.step_seconds(0) == pytest.approx(0.1 + 0.04 + 0.2 + 0.08)
    assert prof.to_dict()["layers"][0]["name"] == "a"


def test_present_gpu_without_measurement_is_estimated_from_its_catalog_match() -> None:
    gpu = torchspan.Device(torch.device("cuda", 0), "NVIDIA L4", total_memory=24 * 2**30)
    prof = torchspan.profile(nn.Sequential(nn.Linear(64, 64)), torch.randn(8, 64), [gpu], measure=False)
    assert prof.layers[0].time_source[0].startswith("estimated: FP32 dense 30.3 TFLOP/s")
    unknown = torchspan.Device(torch.device("cuda", 0), "Mystery GPU")
    with pytest.raises(ValueError, match=r"devices\[0\]='cuda:0'.*no FLOP/s figure"):
        torchspan.profile(nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4), [unknown], measure=False)


def test_profiling_restores_buffers_the_move_to_another_device_swapped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Moving a layer in place (``.to(dev)`` and back) gives it new buffer tensors; their stats are restored
    too."""
    real = measure.on_device

    def swapping(layer: nn.Module, dev: torch.device, dtype: torch.dtype | None):  # type: ignore[no-untyped-def]
        layer.to(torch.float64).to(
            torch.float32
        )  # Module._apply puts new tensors in _buffers, as a device move does
        return real(layer, dev, dtype)

    monkeypatch.setattr(measure, "on_device", swapping)
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 2)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torchspan.profile(model, torch.randn(8, 6) * 5 + 3, "cpu", **FAST)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_measures_on_a_present_gpu_and_puts_the_model_back() -> None:
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    prof = torchspan.profile(model, torch.randn(64, 256), "cuda:0,cpu", **FAST)
    assert [lay.time_source for lay in prof.layers][0] == ["measured", "measured"]
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert prof.layers[0].forward_seconds(0, 64) > 0


def test_calibration_scales_layer_times_to_the_whole_model(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # the whole model takes 1.5x the layers' forward sum and 5x their backward sum (clamped to 2x)
    monkeypatch.setattr(measure, "time_layer", lambda *a, **k: (3.0, 30.0))
    fwd = {"a": {8: 1.0}, "b": {8: 1.0}}
    bwd = {"a": {8: 2.0}, "b": {8: 1.0}}
    scales: list = []
    measure._calibrate(
        torch.nn.Linear(1, 1),
        (torch.zeros(8, 1),),
        ["a", "b"],
        fwd,
        bwd,
        8,
        torch.device("cpu"),
        0,
        1,
        scales,
    )
    assert fwd == {"a": {8: 1.5}, "b": {8: 1.5}}
    assert bwd == {"a": {8: 4.0}, "b": {8: 2.0}}
    assert scales == [(8, 1.5, 2.0)]


def test_profile_notes_the_calibration_on_a_present_cpu() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    prof = torchspan.profile(model, torch.randn(8, 16), "cpu", warmup=0, repeats=1)
    assert any("scaled to match a whole-model pass" in n for n in prof.notes)


def test_the_layer_list_is_computed_once_and_passed_down() -> None:
    """profile() walks the model's children once; sizing (three batch sizes) and timing (two) receive that
    list."""
    import sys

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    real = model.named_children
    walks: list[str] = []

    def counting(*args: object, **kwargs: object) -> object:
        caller = sys._getframe(1).f_code.co_filename
        if "torchspan" in caller:  # torch's own module tracker (FlopCounterMode) walks children too
            walks.append(caller)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    model.named_children = counting  # type: ignore[method-assign]
    prof = torchspan.profile(model, torch.randn(8, 8), "cpu", **FAST)
    assert len(walks) == 1 and walks[0].endswith("discovery.py"), walks
    assert prof.names == ["0", "1", "2"] and all(lay.time_source == ["measured"] for lay in prof.layers)
