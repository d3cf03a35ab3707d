"""Per-layer costs of a model on a set of devices (``torchspan.profile``).

Usage::

    prof = torchspan.profile(model, torch.randn(32, 512), devices="cuda:0,cpu", optimizer="adam")
    prof.layers[0].param_bytes, prof.layers[0].forward_seconds(device=0, samples=8)
    print(prof)                                  # one row per layer

Bytes are per layer (parameters, gradients, optimizer state, buffers) or per sample (saved
activations, boundary output). Times follow ``fixed + samples * per_sample`` per device, measured on
devices that are present and estimated from FLOPs for described ones (``time_source`` says which).

How each figure is obtained
    parameters, gradients, buffers  counted from the module (shared tensors counted once, in the
        first layer that owns them; gradients only for ``requires_grad`` parameters).
    optimizer state  one ``step()`` of the real optimizer class on ``meta`` copies of each distinct
        parameter shape, so any ``torch.optim`` optimizer (and most custom ones) is sized exactly,
        scalars such as Adam's ``step`` included; nothing is allocated.
    activations      a forward/backward under ``FakeTensorMode`` (no memory, no compute) with
        ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves is attributed to
        the layer running when it was saved, storages are counted once, and tensors that share a
        parameter's or buffer's storage are state, not activations. Run at batch B and 2B, the
        difference gives bytes per sample and the rest a fixed part; a third size checks linearity.
    FLOPs, traffic   ``torch.utils.flop_counter.FlopCounterMode`` plus a dispatch mode that adds
        the bytes every aten op reads and writes, per layer, forward and backward separately.
    times            present devices: each layer is run alone on the inputs it received in a real
        forward (captured by hooks on the top-level children), forward then backward, after
        ``warmup`` runs, median of ``repeats``, at batch B and B/4; the line through the two
        points gives ``fixed`` and ``per_sample``. Described devices: per aten op,
        ``max(flops / (peak * compute_efficiency), bytes / (bandwidth * memory_efficiency))`` plus a
        per-op overhead (see ``torchspan.catalog``), evaluated at the same two batch sizes.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import inspect
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .hardware import Device, format_bytes
from .split import top_level_layers

__all__ = ["LayerCost", "Profile", "profile", "optimizer_state_bytes", "OPTIMIZERS"]


@dataclass
class LayerCost:
    """Costs of one layer (a top-level child, named as in ``torchspan.split.execution_order``).

    Lists indexed by device follow ``Profile.devices``.
    """

    name: str
    kind: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    buffer_bytes: int
    activation_bytes: float  # saved for backward, per sample
    output_bytes: float  # what crosses to the next layer, per sample
    flops: float  # forward FLOPs per sample
    forward_fixed: list[float] = field(default_factory=list)  # seconds per call, per device
    forward_per_sample: list[float] = field(default_factory=list)  # seconds per sample, per device
    backward_fixed: list[float] = field(default_factory=list)
    backward_per_sample: list[float] = field(default_factory=list)
    time_source: list[str] = field(default_factory=list)  # "measured" | "estimated: …" per device
    # Added by the profiler; defaults keep hand-built LayerCost objects valid.
    activation_fixed_bytes: float = 0.0  # saved for backward per call, independent of batch size
    output_fixed_bytes: float = 0.0  # boundary bytes per call, independent of batch size
    backward_flops: float = 0.0  # backward FLOPs per sample
    calls: int = 1  # times the layer runs in one forward
    # per sample: bytes this layer saves that an earlier layer saved too (usually its input, which the
    # previous layer kept for its own backward). Counted once above; a stage that STARTS at this layer
    # on another device holds its own copy of them, so add this for a stage's first layer.
    shared_activation_bytes: float = 0.0

    def forward_seconds(self, device: int, samples: float) -> float:
        return self.forward_fixed[device] + samples * self.forward_per_sample[device]

    def backward_seconds(self, device: int, samples: float) -> float:
        return self.backward_fixed[device] + samples * self.backward_per_sample[device]

    @property
    def state_bytes(self) -> int:
        """Memory that stays for the whole run: parameters, gradients, optimizer state, buffers."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.buffer_bytes

    def saved_bytes(self, samples: float) -> float:
        """Bytes autograd keeps for this layer's backward while ``samples`` samples are in flight."""
        return self.activation_fixed_bytes + samples * self.activation_bytes


@dataclass
class Profile:
    """Per-layer costs of a model for an example batch, on ``devices``."""

    layers: list[LayerCost]
    devices: list[Device]
    batch_size: int
    input_bytes: float  # model input, per sample
    optimizer: str
    dtype: str = "float32"
    notes: list[str] = field(default_factory=list)
    # measured / estimated step time on present CPUs: how far the FLOP-based estimate is off here
    calibration: dict[str, float] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [lay.name for lay in self.layers]

    def layer(self, name: str) -> LayerCost:
        """The ``LayerCost`` called ``name``; ``KeyError`` listing the names otherwise."""
        for lay in self.layers:
            if lay.name == name:
                return lay
        raise KeyError(f"no layer {name!r} in this profile; layers are {', '.join(self.names)}")

    def step_seconds(self, device: int, samples: float | None = None) -> float:
        """Forward plus backward of every layer on ``devices[device]`` for ``samples`` (default: the batch)."""
        s = self.batch_size if samples is None else samples
        return sum(lay.forward_seconds(device, s) + lay.backward_seconds(device, s) for lay in self.layers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": [d.to_dict() for d in self.devices],
            "batch_size": self.batch_size,
            "input_bytes": self.input_bytes,
            "optimizer": self.optimizer,
            "dtype": self.dtype,
            "notes": list(self.notes),
            "calibration": dict(self.calibration),
            "layers": [dataclasses.asdict(lay) for lay in self.layers],
        }

    def __str__(self) -> str:
        b = self.batch_size
        head = f"Profile: {len(self.layers)} layer(s), batch {b}, optimizer {self.optimizer}, dtype {self.dtype}"
        devs = [f"[{i}] {d.device} {d.name} ({src})" for i, d in enumerate(self.devices) for src in [_short_source(self, i)]]
        cols = ["layer", "kind", "params", "grads", "optim", "buffers", "act/sample", "out/sample", "MFLOP/sample"]
        cols += [f"fwd+bwd ms [{i}]" for i in range(len(self.devices))]
        rows = [cols]
        for lay in self.layers:
            row = [
                lay.name,
                lay.kind,
                format_bytes(lay.param_bytes),
                format_bytes(lay.grad_bytes),
                format_bytes(lay.optimizer_bytes),
                format_bytes(lay.buffer_bytes),
                format_bytes(lay.activation_bytes),
                format_bytes(lay.output_bytes),
                f"{lay.flops / 1e6:.2f}",
            ]
            for i in range(len(self.devices)):
                t = lay.forward_seconds(i, b) + lay.backward_seconds(i, b) if i < len(lay.forward_fixed) else float("nan")
                row.append(f"{t * 1e3:.3f}")
            rows.append(row)
        widths = [max(len(r[c]) for r in rows) for c in range(len(cols))]
        lines = [head, *devs]
        for j, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) if k < 2 else c.rjust(w) for k, (c, w) in enumerate(zip(r, widths))))
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def _short_source(prof: Profile, i: int) -> str:
    if not prof.layers or i >= len(prof.layers[0].time_source):
        return "-"
    src = prof.layers[0].time_source[i]
    return "measured" if src == "measured" else "estimated"


# =========================================================================== optimizer state

OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "none": ("", {}),
    "sgd": ("SGD", {}),
    "sgd-momentum": ("SGD", {"momentum": 0.9}),
    "momentum": ("SGD", {"momentum": 0.9}),
    "adam": ("Adam", {}),
    "adamw": ("AdamW", {}),
    "adam-amsgrad": ("Adam", {"amsgrad": True}),
    "adamax": ("Adamax", {}),
    "nadam": ("NAdam", {}),
    "radam": ("RAdam", {}),
    "rmsprop": ("RMSprop", {}),
    "adagrad": ("Adagrad", {}),
    "adadelta": ("Adadelta", {}),
    "rprop": ("Rprop", {}),
    "asgd": ("ASGD", {}),
    "adafactor": ("Adafactor", {}),
}


@dataclass(frozen=True)
class _OptimizerSpec:
    label: str
    cls: type[torch.optim.Optimizer] | None
    kwargs: dict[str, Any]
    groups: dict[int, dict[str, Any]] | None  # id(param) -> hyper-parameters, from an instance


def _optimizer_spec(optimizer: Any) -> _OptimizerSpec:
    if optimizer is None:
        return _OptimizerSpec("none", None, {}, None)
    if isinstance(optimizer, str):
        key = optimizer.strip().lower().replace("_", "-").replace(" ", "-")
        if key not in OPTIMIZERS:
            raise ValueError(
                f"optimizer={optimizer!r} is not known; use one of {', '.join(OPTIMIZERS)}, "
                "a torch.optim.Optimizer subclass, or an optimizer instance"
            )
        cls_name, kwargs = OPTIMIZERS[key]
        cls = getattr(torch.optim, cls_name, None) if cls_name else None
        if cls_name and cls is None:
            raise ValueError(f"optimizer={optimizer!r} needs torch.optim.{cls_name}, which this PyTorch ({torch.__version__}) lacks")
        return _OptimizerSpec(key, cls, dict(kwargs), None)
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return _OptimizerSpec(optimizer.__name__.lower(), optimizer, {}, None)
    if isinstance(optimizer, torch.optim.Optimizer):
        groups: dict[int, dict[str, Any]] = {}
        for group in optimizer.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                groups[id(p)] = hyper
        return _OptimizerSpec(type(optimizer).__name__.lower(), type(optimizer), {}, groups)
    raise ValueError(
        f"optimizer={optimizer!r} ({type(optimizer).__name__}) is not an optimizer; use a name "
        f"({', '.join(OPTIMIZERS)}), a torch.optim.Optimizer subclass, or an instance"
    )


def _constructor_kwargs(cls: type, hyper: dict[str, Any]) -> dict[str, Any]:
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without signatures
        return {}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(hyper)
    return {k: v for k, v in hyper.items() if k in params}


def _state_bytes_for(cls: type[torch.optim.Optimizer], hyper: dict[str, Any], shape: torch.Size, dtype: torch.dtype) -> int:
    """Bytes of optimizer state one parameter of ``shape``/``dtype`` gets, from a step on ``meta``."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"))
    p.grad = torch.empty_like(p)
    kwargs = _constructor_kwargs(cls, hyper)
    kwargs.pop("foreach", None)
    kwargs.pop("fused", None)
    try:
        opt = cls([p], **kwargs)
    except Exception as exc:
        raise ValueError(
            f"optimizer {cls.__name__}({kwargs}) could not be built to size its state ({type(exc).__name__}: {exc}); "
            "pass an optimizer name such as 'adam' or 'sgd' instead"
        ) from None
    try:
        opt.step()
    except Exception:
        # Optimizers create their state before the arithmetic; a data-dependent step (.item() on
        # meta) still leaves the state behind, which is all that is needed here.
        pass
    state = opt.state.get(p, {})
    total = 0
    for value in state.values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
    return total


def optimizer_state_bytes(params: Sequence[nn.Parameter], optimizer: Any = "adam", dtype: torch.dtype | None = None) -> int:
    """Bytes of optimizer state ``optimizer`` keeps for ``params`` (trainable ones only).

    Usage: ``optimizer_state_bytes(list(nn.Linear(4, 2).parameters()), "adam") == 2 * 40 + 2 * 4``
    (two moments per weight and bias, plus Adam's float32 ``step`` scalar per tensor).
    """
    spec = _optimizer_spec(optimizer)
    return sum(_param_state_bytes(spec, p, dtype, {}) for p in params)


def _param_state_bytes(spec: _OptimizerSpec, p: torch.Tensor, dtype: torch.dtype | None, cache: dict[Any, int]) -> int:
    if spec.cls is None or not p.requires_grad:
        return 0
    if spec.groups is not None:
        hyper = spec.groups.get(id(p))
        if hyper is None:
            return 0  # the optimizer instance does not update this parameter
    else:
        hyper = spec.kwargs
    dt = dtype if dtype is not None and p.is_floating_point() else p.dtype
    key = (spec.cls, tuple(sorted((k, repr(v)) for k, v in hyper.items())), tuple(p.shape), dt)
    if key not in cache:
        cache[key] = _state_bytes_for(spec.cls, hyper, p.shape, dt)
    return cache[key]


# =========================================================================== inputs


def _as_args(example_inputs: Any) -> tuple[Any, ...]:
    return tuple(example_inputs) if isinstance(example_inputs, tuple) else (example_inputs,)


def _batch_size(args: tuple[Any, ...]) -> int:
    for leaf in tree_flatten(args)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            if leaf.shape[0] < 1:
                raise ValueError(f"example_inputs has a tensor of shape {tuple(leaf.shape)}: the batch (dim 0) is empty")
            return int(leaf.shape[0])
    raise ValueError(
        "example_inputs holds no tensor with a batch dimension; pass a batch (e.g. torch.randn(32, 512)) "
        "or a tuple of arguments whose first tensor has the batch size in dim 0"
    )


def _resize_batch(args: Any, batch: int, size: int, make: Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]) -> Any:
    """Every tensor whose dim 0 is ``batch`` rebuilt with dim 0 ``size`` by ``make(t, shape)``."""

    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            shape = (size, *t.shape[1:]) if t.dim() >= 1 and t.shape[0] == batch else tuple(t.shape)
            return make(t, shape)
        return t

    return tree_map(one, args)


def _bytes_of(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor))


def _float_dtype(model: nn.Module, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


# =========================================================================== sizing pass (fake tensors)


@dataclass
class _Sizes:
    """What one fake forward/backward at one batch size saw, per layer."""

    order: list[str]
    saved: dict[str, int]
    shared: dict[str, int]
    output: dict[str, int]
    calls: dict[str, int]
    requires_grad: dict[str, list[list[bool]]]  # per call, per flattened input leaf
    ops: dict[tuple[str | None, str], list[tuple[float, float]]]  # (layer, phase) -> [(flops, bytes)]


class _OpRecorder:
    """Dispatch mode that records (flops, bytes read+written) of every aten op for the current segment."""

    def __init__(self, counter: Any, sink: Callable[[float, float], None]) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                kwargs = kwargs or {}
                before = counter.get_total_flops()
                out = func(*args, **kwargs)
                name = getattr(func, "namespace", "")
                if name == "aten":
                    flops = counter.get_total_flops() - before
                    moved = 0 if getattr(func, "is_view", False) else _bytes_of((args, kwargs)) + _bytes_of(out)
                    recorder.sink(float(flops), float(moved))
                return out

        self.sink = sink
        self.mode = _Mode()


def _sizing_pass(model: nn.Module, args: tuple[Any, ...], batch: int, size: int, dtype: torch.dtype | None) -> _Sizes:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils.flop_counter import FlopCounterMode

    children = top_level_layers(model)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)

    def cast(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    with fake_mode:
        state: dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters():
            state[name] = torch.empty(tuple(p.shape), dtype=cast(p), device="cpu").requires_grad_(p.requires_grad)
        for name, b in model.named_buffers():
            state[name] = torch.empty(tuple(b.shape), dtype=cast(b), device="cpu")
        fargs = _resize_batch(args, batch, size, lambda t, shape: torch.empty(shape, dtype=cast(t), device="cpu"))
    state_keys = {StorageWeakRef(t.untyped_storage()).cdata for t in state.values()}

    zeros = {n: 0 for n, _ in children}
    sizes = _Sizes([], dict(zeros), dict(zeros), dict(zeros), dict(zeros), {n: [] for n, _ in children}, {})
    first_saver: dict[int, str] = {}
    shared_seen: set[tuple[str, int]] = set()
    stack: list[str] = []
    segment: list[tuple[str | None, str]] = [(None, "forward")]

    def sink(flops: float, moved: float) -> None:
        sizes.ops.setdefault(segment[0], []).append((flops, moved))

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
            key = StorageWeakRef(storage).cdata
            nbytes = storage.nbytes()
        except Exception:  # tensors without storage (sparse, nested): count their elements
            key, nbytes = id(t), t.numel() * t.element_size()
        if key in state_keys:
            return t
        owner = stack[-1] if stack else (sizes.order[-1] if sizes.order else children[0][0])
        first = first_saver.setdefault(key, owner)
        if first == owner:
            if (owner, key) not in shared_seen:
                shared_seen.add((owner, key))
                sizes.saved[owner] += nbytes
        elif (owner, key) not in shared_seen:
            shared_seen.add((owner, key))
            sizes.shared[owner] += nbytes
        return t

    handles = []
    for cname, child in children:

        def pre(_m: nn.Module, a: Any, kw: Any, _n: str = cname) -> None:
            if _n not in sizes.order:
                sizes.order.append(_n)
            sizes.calls[_n] += 1
            sizes.requires_grad[_n].append([isinstance(x, torch.Tensor) and x.requires_grad for x in tree_flatten((a, kw))[0]])
            stack.append(_n)
            segment[0] = (_n, "forward")

        def post(_m: nn.Module, _a: Any, _kw: Any, out: Any, _n: str = cname) -> None:
            stack.pop()
            segment[0] = (stack[-1] if stack else None, "forward")
            sizes.output[_n] += _bytes_of(out)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:

                    def start_backward(grad: torch.Tensor, _n: str = _n) -> None:
                        segment[0] = (_n, "backward")

                    t.register_hook(start_backward)

        handles.append(child.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(child.register_forward_hook(post, with_kwargs=True))

    counter = FlopCounterMode(display=False)
    recorder = _OpRecorder(counter, sink)
    try:
        with fake_mode, counter, recorder.mode:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = torch.func.functional_call(model, state, fargs, strict=False, tie_weights=True)
            segment[0] = (None, "backward")
            roots = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if roots:
                torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
    finally:
        for h in handles:
            h.remove()
    if isinstance(model, nn.Sequential) or not sizes.order:
        sizes.order = [n for n, _ in children]
    else:
        sizes.order.extend(n for n, _ in children if n not in sizes.order)
    return sizes


# =========================================================================== timing (present devices)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":  # pragma: no cover - Apple only
        torch.mps.synchronize()


@contextmanager
def _preserved(model: nn.Module) -> Iterator[None]:
    """Restore buffers (e.g. BatchNorm statistics), gradients and RNG state after measuring.

    Python's garbage collector is paused meanwhile (as ``timeit`` does): a collection of the
    sizing pass's objects inside a timed region would add milliseconds to one layer.
    """
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    grads = [(p, p.grad) for p in model.parameters()]
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            if was_enabled:
                gc.enable()
            with torch.no_grad():
                for b, saved in buffers:
                    if b.device == saved.device and b.shape == saved.shape:
                        b.copy_(saved)
            for p, g in grads:
                p.grad = g


def _capture(model: nn.Module, args: tuple[Any, ...], names: list[str]) -> dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]]:
    """Inputs every top-level child receives in one real forward (no autograd graph kept)."""
    calls: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {n: [] for n in names}
    handles = []
    for name, child in top_level_layers(model):

        def pre(_m: nn.Module, a: Any, kw: Any, _n: str = name) -> None:
            detached = tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, (a, kw))
            calls[_n].append(detached)

        handles.append(child.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        with torch.no_grad():
            model(*args)
    finally:
        for h in handles:
            h.remove()
    return calls


def _module_device(module: nn.Module) -> torch.device | None:
    devs = {t.device for t in list(module.parameters()) + list(module.buffers())}
    return devs.pop() if len(devs) == 1 else None


@contextmanager
def _on_device(layer: nn.Module, dev: torch.device, dtype: torch.dtype | None) -> Iterator[nn.Module]:
    """``layer`` on ``dev`` in ``dtype``: moved in place and back, or a copy when it must be cast."""
    tensors = list(layer.parameters()) + list(layer.buffers())
    needs_cast = dtype is not None and any(t.is_floating_point() and t.dtype != dtype for t in tensors)
    home = _module_device(layer)
    if not tensors or (home == dev and not needs_cast):
        yield layer
        return
    if needs_cast or home is None:
        yield copy.deepcopy(layer).to(device=dev, dtype=dtype) if dtype is not None else copy.deepcopy(layer).to(dev)
        return
    layer.to(dev)
    try:
        yield layer
    finally:
        layer.to(home)


def _time_layer(
    module: nn.Module,
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]],
    grad_mask: list[list[bool]],
    dev: torch.device,
    dtype: torch.dtype | None,
    warmup: int,
    repeats: int,
) -> tuple[float, float]:
    """Median forward and backward seconds of ``module`` over its recorded calls."""

    def to_dev(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        t = t.to(dev)
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    prepared = []
    for i, (a, kw) in enumerate(calls):
        leaves, spec = tree_flatten(tree_map(to_dev, (a, kw)))
        mask = grad_mask[i] if i < len(grad_mask) and len(grad_mask[i]) == len(leaves) else [False] * len(leaves)
        prepared.append((leaves, spec, mask))
    params = [p for p in module.parameters() if p.requires_grad]
    fwd: list[float] = []
    bwd: list[float] = []
    for it in range(warmup + repeats):
        inputs = []
        for leaves, spec, mask in prepared:
            fresh = [
                x.detach().requires_grad_(True).clone() if m and isinstance(x, torch.Tensor) and x.is_floating_point() else x
                for x, m in zip(leaves, mask)
            ]
            inputs.append(tree_unflatten(fresh, spec))
        for p in params:
            p.grad = None
        _sync(dev)
        t0 = time.perf_counter()
        outs = [module(*a, **kw) for a, kw in inputs]
        _sync(dev)
        t1 = time.perf_counter()
        roots = [t for t in tree_flatten(outs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        seeds = [torch.ones_like(t) for t in roots]
        _sync(dev)
        t2 = time.perf_counter()
        if roots:
            torch.autograd.backward(roots, seeds)
        _sync(dev)
        t3 = time.perf_counter()
        if it >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t3 - t2 if roots else 0.0)
        del outs, roots, seeds, inputs
    for p in params:
        p.grad = None
    return statistics.median(fwd), statistics.median(bwd)


def _fit(points: dict[int, float]) -> tuple[float, float]:
    """``(fixed, per_sample)`` of the line through the timing points, both kept >= 0."""
    if len(points) == 1:
        (s, t), = points.items()
        return 0.0, t / s
    (s1, t1), (s2, t2) = sorted(points.items())[:2]
    per = (t2 - t1) / (s2 - s1)
    fixed = t1 - s1 * per
    if per < 0:  # noise (stalls only ever add time): the larger batch was faster; keep its time as fixed
        return t2, 0.0
    if fixed < 0:
        return 0.0, t2 / s2
    return fixed, per


# =========================================================================== estimates (described devices)


@dataclass(frozen=True)
class _Speed:
    flops: float
    bandwidth: float | None
    overhead: float
    asynchronous: bool
    label: str


def _speed_of(device: Device, dtype: torch.dtype) -> _Speed:
    from . import catalog

    peak, precision = catalog.flops_for(device, dtype)
    extra = device.extra if isinstance(device.extra, dict) else {}
    ce = float(extra.get("compute_efficiency", 1.0))
    me = float(extra.get("memory_efficiency", 1.0))
    bw = extra.get("memory_bandwidth")
    overhead = float(extra.get("kernel_overhead", 0.0))
    label = f"estimated: {precision} {peak / 1e12:.3g} TFLOP/s x {ce:g}"
    label += f", {float(bw) / 1e9:.0f} GB/s x {me:g}" if bw else ", memory traffic not modelled (no bandwidth figure)"
    label += f", {overhead * 1e6:.0f} us/op"
    return _Speed(peak * ce, float(bw) * me if bw else None, overhead, device.kind != "cpu", label)


def _host_speed_device(device: Device) -> Device:
    """A present CPU (or meta stand-in) with measured host figures filled in."""
    from . import catalog

    hs = catalog.measure_host()
    extra = dict(device.extra)
    extra.update(
        {
            "memory_bandwidth": hs.memory_bandwidth,
            "kernel_overhead": hs.op_overhead,
            "compute_efficiency": 1.0,
            "memory_efficiency": 1.0,
            "peak_flops_precision": "FP32 matmul, measured",
            "speed_source": hs.method,
        }
    )
    return dataclasses.replace(device, peak_flops=hs.flops, extra=extra)


def _estimate(ops: list[tuple[float, float]], speed: _Speed) -> float:
    if not ops:
        return 0.0
    work = 0.0
    for flops, moved in ops:
        t = flops / speed.flops if speed.flops > 0 else 0.0
        if speed.bandwidth:
            t = max(t, moved / speed.bandwidth)
        work += t
    launch = len(ops) * speed.overhead
    return max(work, launch) if speed.asynchronous else work + launch


# =========================================================================== profile()


def _kind(module: nn.Module) -> str:
    return type(module).__name__


def profile(
    model: nn.Module,
    example_inputs: Any,
    devices: Any = "auto",
    optimizer: Any = "adam",
    dtype: torch.dtype | str | None = None,
    *,
    warmup: int = 2,
    repeats: int = 5,
    measure: bool = True,
) -> Profile:
    """Measure and estimate per-layer costs of training ``model`` on ``example_inputs``.

    Usage::

        prof = torchspan.profile(model, torch.randn(32, 512), "a100-40gb*2,cpu", optimizer="adamw")

    ``example_inputs``: a batch tensor, or a tuple of forward arguments (dim 0 of the first tensor
    is the batch size). ``devices``: anything ``torchspan.devices`` accepts. ``optimizer``: a name
    (see ``OPTIMIZERS``), a ``torch.optim.Optimizer`` subclass or instance (its hyper-parameters,
    e.g. SGD momentum, decide the state). ``dtype``: profile as if floating parameters and inputs
    were cast to it (default: the model's). ``warmup``/``repeats``: timing runs per layer and batch
    size. ``measure=False`` estimates present devices too (from this CPU's measured speed).

    The model's parameters, buffers, gradients and RNG state are as before when this returns; the
    model runs in its current mode (call ``model.train()`` first for training figures).
    """
    from .hardware import devices as find_devices

    if not isinstance(model, nn.Module):
        raise ValueError(f"model={type(model).__name__} is not an nn.Module; pass the model to profile")
    for name, value in (("warmup", warmup), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "repeats" else 0):
            raise ValueError(f"{name}={value!r} must be an int >= {1 if name == 'repeats' else 0}")
    dtype = _parse_dtype(dtype)
    args = _as_args(example_inputs)
    batch = _batch_size(args)
    devs = find_devices(devices)
    spec = _optimizer_spec(optimizer)
    compute_dtype = _float_dtype(model, dtype)
    children = dict(top_level_layers(model))
    notes: list[str] = []

    # ---- sizes, FLOPs and traffic from fake passes
    # a second, smaller batch for the time fit (>= 2 samples: BatchNorm refuses one in training)
    small = min(batch, max(2, batch // 4))
    sizes_at: dict[int, _Sizes] = {}
    for s in sorted({small, batch, 2 * batch}, reverse=True):
        try:
            sizes_at[s] = _sizing_pass(model, args, batch, s, dtype)
        except Exception as exc:
            if s == small and small != batch:
                notes.append(f"the model does not run at batch {small} ({type(exc).__name__}); times are fit through 0 from batch {batch} alone")
                small = batch
                continue
            raise ValueError(
                f"could not size {type(model).__name__} with fake tensors at batch {s} "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); data-dependent Python "
                "control flow (e.g. `if x.sum() > 0`, `.item()`) or ops without fake/meta kernels prevent sizing"
            ) from exc
    base = sizes_at[batch]
    order = base.order

    # ---- per-layer state bytes
    owned: set[int] = set()
    cache: dict[Any, int] = {}
    layers: list[LayerCost] = []
    for name in order:
        child = children[name]
        pb = gb = ob = bb = 0
        for p in child.parameters():
            if id(p) in owned:
                continue
            owned.add(id(p))
            size = p.numel() * (_itemsize(dtype) if dtype is not None and p.is_floating_point() else p.element_size())
            pb += size
            if p.requires_grad:
                gb += size
            ob += _param_state_bytes(spec, p, dtype, cache)
        for b in child.buffers():
            if id(b) in owned:
                continue
            owned.add(id(b))
            bb += b.numel() * (_itemsize(dtype) if dtype is not None and b.is_floating_point() else b.element_size())
        act_ps, act_fixed = _per_sample(sizes_at, batch, lambda sz, n=name: sz.saved[n])
        out_ps, out_fixed = _per_sample(sizes_at, batch, lambda sz, n=name: sz.output[n])
        shared_ps, _ = _per_sample(sizes_at, batch, lambda sz, n=name: sz.shared[n])
        fwd_f, _ = _per_sample(sizes_at, batch, lambda sz, n=name: sum(f for f, _ in sz.ops.get((n, "forward"), [])))
        bwd_f, _ = _per_sample(sizes_at, batch, lambda sz, n=name: sum(f for f, _ in sz.ops.get((n, "backward"), [])))
        if not _linear(sizes_at, small, batch, lambda sz, n=name: sz.saved[n]):
            notes.append(f"layer {name!r}: saved-activation bytes are not linear in the batch size; figures fit batch {batch}..{2 * batch}")
        layers.append(
            LayerCost(
                name=name,
                kind=_kind(child),
                param_bytes=pb,
                grad_bytes=gb,
                optimizer_bytes=ob,
                buffer_bytes=bb,
                activation_bytes=act_ps,
                output_bytes=out_ps,
                flops=fwd_f,
                activation_fixed_bytes=act_fixed,
                output_fixed_bytes=out_fixed,
                backward_flops=bwd_f,
                calls=base.calls[name],
                shared_activation_bytes=shared_ps,
            )
        )
    glue = sum(f for (n, _), ops in base.ops.items() if n is None for f, _ in ops)
    total = sum(f for ops in base.ops.values() for f, _ in ops)
    if total and glue / total > 0.05:
        notes.append(f"{glue / total:.0%} of FLOPs run outside the top-level children (in the model's own forward) and are not in any layer")

    # ---- times per device
    meta_params = any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    if meta_params and measure:
        notes.append("parameters are on meta (no data): times on present devices are estimated, not measured")
    out_devices: list[Device] = []
    measured: dict[str, dict[str, tuple[float, float, float, float]]] = {}
    for d in devs:
        present_cpu = d.present and d.kind in ("cpu", "meta")
        dd = _host_speed_device(d) if present_cpu else d
        out_devices.append(dd)
        can_measure = measure and d.present and d.kind != "meta" and not meta_params
        key = str(d.device)
        if can_measure and key not in measured:
            measured[key] = _measure(model, args, batch, small, order, base, d.device, dtype, warmup, repeats)
    for i, (d, dd) in enumerate(zip(devs, out_devices)):
        key = str(d.device)
        if key in measured:
            for lay in layers:
                ff, fp, bf, bp = measured[key][lay.name]
                _append_times(lay, ff, fp, bf, bp, "measured")
            continue
        try:
            speed = _speed_of(dd, compute_dtype)
        except ValueError as exc:
            raise ValueError(f"devices[{i}]={key!r}: {exc}") from None
        label = speed.label + (" (meta has no speed of its own; this CPU's figures)" if d.kind == "meta" else "")
        for lay in layers:
            _append_times(lay, *_estimate_layer(sizes_at, small, batch, lay.name, speed), label)

    # ---- how well FLOP-based estimates match measurements on this machine
    calibration: dict[str, float] = {}
    for i, (d, dd) in enumerate(zip(devs, out_devices)):
        key = str(d.device)
        if key in measured and d.kind == "cpu" and key not in calibration:
            speed = _speed_of(dd, compute_dtype)
            est = sum(sum(_estimate_pair(sizes_at, batch, lay.name, speed)) for lay in layers)
            meas = sum(lay.forward_seconds(i, batch) + lay.backward_seconds(i, batch) for lay in layers)
            if est > 0:
                calibration[key] = meas / est
    return Profile(
        layers=layers,
        devices=out_devices,
        batch_size=batch,
        input_bytes=_bytes_of(args) / batch,
        optimizer=spec.label,
        dtype=str(compute_dtype).replace("torch.", ""),
        notes=notes,
        calibration=calibration,
    )


def _append_times(lay: LayerCost, ff: float, fp: float, bf: float, bp: float, source: str) -> None:
    lay.forward_fixed.append(ff)
    lay.forward_per_sample.append(fp)
    lay.backward_fixed.append(bf)
    lay.backward_per_sample.append(bp)
    lay.time_source.append(source)


def _estimate_pair(sizes_at: dict[int, _Sizes], s: int, name: str, speed: _Speed) -> tuple[float, float]:
    sz = sizes_at[s]
    return _estimate(sz.ops.get((name, "forward"), []), speed), _estimate(sz.ops.get((name, "backward"), []), speed)


def _estimate_layer(sizes_at: dict[int, _Sizes], small: int, batch: int, name: str, speed: _Speed) -> tuple[float, float, float, float]:
    fwd: dict[int, float] = {}
    bwd: dict[int, float] = {}
    for s in {small, batch}:
        fwd[s], bwd[s] = _estimate_pair(sizes_at, s, name, speed)
    ff, fp = _fit(fwd)
    bf, bp = _fit(bwd)
    return ff, fp, bf, bp


def _measure(
    model: nn.Module,
    args: tuple[Any, ...],
    batch: int,
    small: int,
    order: list[str],
    base: _Sizes,
    dev: torch.device,
    dtype: torch.dtype | None,
    warmup: int,
    repeats: int,
) -> dict[str, tuple[float, float, float, float]]:
    children = dict(top_level_layers(model))
    fwd: dict[str, dict[int, float]] = {n: {} for n in order}
    bwd: dict[str, dict[int, float]] = {n: {} for n in order}
    with _preserved(model):
        for s in sorted({small, batch}):
            sub = args if s == batch else _resize_batch(args, batch, s, lambda t, shape: t[: shape[0]] if tuple(t.shape) != shape else t)
            calls = _capture(model, sub, order)
            for name in order:
                if not calls[name]:
                    fwd[name][s] = bwd[name][s] = 0.0
                    continue
                with _on_device(children[name], dev, dtype) as module:
                    fwd[name][s], bwd[name][s] = _time_layer(module, calls[name], base.requires_grad[name], dev, dtype, warmup, repeats)
            del calls
    out = {}
    for name in order:
        ff, fp = _fit(fwd[name])
        bf, bp = _fit(bwd[name])
        out[name] = (ff, fp, bf, bp)
    return out


def _per_sample(sizes_at: dict[int, _Sizes], batch: int, get: Callable[[_Sizes], float]) -> tuple[float, float]:
    """``(per_sample, fixed)`` from the passes at ``batch`` and ``2 * batch``."""
    a1 = float(get(sizes_at[batch]))
    a2 = float(get(sizes_at[2 * batch]))
    per = max(0.0, (a2 - a1) / batch)
    fixed = max(0.0, a1 - batch * per)
    return per, fixed


def _linear(sizes_at: dict[int, _Sizes], small: int, batch: int, get: Callable[[_Sizes], float]) -> bool:
    if small == batch:
        return True
    per, fixed = _per_sample(sizes_at, batch, get)
    predicted = fixed + small * per
    actual = float(get(sizes_at[small]))
    return abs(predicted - actual) <= 0.01 * max(predicted, actual) + 64


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        value = getattr(torch, dtype.strip().replace("torch.", ""), None)
        if isinstance(value, torch.dtype):
            return value
    raise ValueError(f"dtype={dtype!r} is not a torch dtype; use e.g. torch.bfloat16 or 'float32'")
