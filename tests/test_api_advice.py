"""API probes from fuzzing (issue 29): each row is a call a user makes, and it either works as its words
promise or is one clear error naming the argument, the file or the fix (never a raw JSONDecodeError,
FileNotFoundError or TypeError, never an option silently ignored, never advice naming an option that does not
exist).

- ``TIED``: a model whose config ties its embeddings (``tie_word_embeddings``), built on ``meta`` any way
  (``accelerate.init_empty_weights()``, which breaks the tie under transformers 5.x; ``torch.device("meta")``;
  ``from_config``), comes out of ``span(..., weights=...)`` tied, with a normal build's values.
- ``REFUSALS``: bad calls, one line each (``reshard_after_forward=False`` without sharding, a garbage or
truncated
  safetensors file or index, a sharded folder missing a shard, a target with autograd history sent to spawned
  ranks, a pipeline job's per-rank checkpoint exported).
- BatchNorm under ``span(..., shard=True)`` names ``per_shard_batchnorm=True``, and that option is ``span``'s.
- The launcher's summary says a rank it stopped was stopped by it, not that it "also failed".
- A DataLoader worker is told ``rank=``/``world_size=`` only by the calls that take them.

Every row fails on the code before issue 29's fixes but the untied and already-tied builds (kept as the
contrast).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchspan

transformers = pytest.importorskip("transformers")


def _config(tie: bool = True) -> Any:
    return transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tie,
        max_position_embeddings=32,
    )


def _empty_weights() -> contextlib.AbstractContextManager[Any]:
    accelerate = pytest.importorskip("accelerate")
    return accelerate.init_empty_weights()


# each builds the tied Llama on meta its own way
BUILDS: dict[str, Callable[[], nn.Module]] = {}


def _build(name: str) -> Callable[[Callable[[], nn.Module]], Callable[[], nn.Module]]:
    def add(fn: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        BUILDS[name] = fn
        return fn

    return add


@_build("init_empty_weights")
def _iew() -> nn.Module:
    with _empty_weights():
        return transformers.LlamaForCausalLM(_config())


@_build("init_empty_weights, from_config")
def _iew_from_config() -> nn.Module:
    with _empty_weights():
        return transformers.AutoModelForCausalLM.from_config(_config())


@_build("torch.device('meta')")
def _meta() -> nn.Module:
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(_config())


@_build("torch.device('meta'), from_config")
def _meta_from_config() -> nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(_config())


def _tied(model: nn.Module) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


@pytest.mark.parametrize("source", ["init", "safetensors folder", "safetensors file", "checkpoint folder"])
@pytest.mark.parametrize("build", list(BUILDS))
def test_a_tied_config_is_tied_after_weights(build: str, source: str, tmp_path: Path) -> None:
    torch.manual_seed(3)
    reference = transformers.LlamaForCausalLM(_config())
    assert _tied(reference)
    if source.startswith("safetensors"):
        reference.save_pretrained(tmp_path)  # the tie is saved once (under model.embed_tokens.weight)
    elif source == "checkpoint folder":
        torchspan.save_checkpoint(tmp_path / "ckpt", {"model": reference})
    weights = {
        "init": "init",
        "safetensors folder": tmp_path,
        "safetensors file": tmp_path / "model.safetensors",
        "checkpoint folder": tmp_path / "ckpt",
    }[source]
    torch.manual_seed(3)
    model = BUILDS[build]()
    spanned = torchspan.span(model, weights=weights)
    assert _tied(spanned.module), (
        f"{build}, weights={source}: lm_head.weight is not model.embed_tokens.weight"
    )
    got = dict(spanned.module.named_parameters())
    assert list(got) == [n for n, _ in reference.named_parameters()]
    for name, value in reference.named_parameters():
        torch.testing.assert_close(
            got[name], value, rtol=0, atol=0, msg=lambda m: f"{build}, {source}: {name}: {m}"
        )


def test_an_untied_config_stays_untied() -> None:
    with _empty_weights():
        model = transformers.LlamaForCausalLM(_config(tie=False))
    spanned = torchspan.span(model, weights="init")
    assert not _tied(spanned.module)


class _TiedByConfig(nn.Module):
    """Says its embeddings are tied (a config with tie_word_embeddings) but has no tie_weights() of its
    own."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(tie_word_embeddings=True)
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def test_a_model_without_tie_weights_gets_its_output_embedding_tied_to_its_input() -> None:
    with torch.device("meta"):
        model = _TiedByConfig()
    spanned = torchspan.span(model, weights="init")
    assert spanned.module.head.weight is spanned.module.embed.weight


# ------------------------------------------------------------------------------------------------ refusals
def _tie_of_two_shapes(tmp: Path) -> None:
    with torch.device("meta"):
        model = _TiedByConfig()
        model.head = nn.Linear(4, 12, bias=False)
    torchspan.span(model, weights="init")


def _meta_llama() -> nn.Module:
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(_config())


def _garbage_safetensors(tmp: Path) -> None:
    (tmp / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"x" * 64)
    torchspan.span(_meta_llama(), weights=tmp / "bad.safetensors")


def _huge_header(tmp: Path) -> None:
    (tmp / "huge.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    torchspan.span(_meta_llama(), weights=tmp / "huge.safetensors")


def _missing_shard(tmp: Path) -> None:
    transformers.LlamaForCausalLM(_config()).save_pretrained(tmp, max_shard_size="5KB")
    shards = sorted(tmp.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    torchspan.span(_meta_llama(), weights=tmp)


def _garbage_index(tmp: Path) -> None:
    (tmp / "model.safetensors.index.json").write_text("{not json")
    torchspan.span(_meta_llama(), weights=tmp)


def _export_pipeline_file(tmp: Path) -> None:
    # what save_checkpoint writes in a pipeline job: one state per rank, each holding only its stage
    ranks = [
        {"model": {"0.weight": torch.zeros(2, 2)}, "step": 1},
        {"model": {"1.weight": torch.zeros(2, 2)}, "step": 1},
    ]
    torch.save({"torchspan_ranks": ranks}, tmp / "ckpt.pt")
    torchspan.export_safetensors(tmp / "ckpt.pt", tmp / "out")


class _Holder:
    """An object tree_map does not enter holding a tensor with autograd history (as a transformers cache
    does)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _first_mse(out: torch.Tensor, target: list[Any]) -> torch.Tensor:
    return nn.functional.mse_loss(out, target[0])


def _target_with_history(tmp: Path) -> None:
    import functools

    from torchspan.parity_ranks import compare_strategies

    target = [torch.randn(6, 2), _Holder(torch.ones(2, requires_grad=True) * 2)]
    compare_strategies(
        nn.Linear(4, 2),
        torch.randn(6, 4),
        target,
        _first_mse,
        ["dp"],
        build=functools.partial(nn.Linear, 4, 2),
        nproc=2,
    )


# (id, the call, exception type, words the one-line message must contain)
REFUSALS: list[tuple[str, Callable[[Path], Any], type[BaseException], str]] = [
    (
        "reshard_after_forward=False without shard=True",
        lambda t: torchspan.span(nn.Linear(2, 2), reshard_after_forward=False),
        ValueError,
        "reshard_after_forward=False needs shard=True",
    ),
    ("a declared tie of two shapes", _tie_of_two_shapes, ValueError, "'head.weight' tied to 'embed.weight'"),
    ("weights= a garbage .safetensors file", _garbage_safetensors, ValueError, "bad.safetensors"),
    (
        "weights= a .safetensors file whose header size is absurd",
        _huge_header,
        ValueError,
        "huge.safetensors",
    ),
    ("weights= a sharded safetensors folder missing a shard", _missing_shard, ValueError, "model-00002-of-"),
    (
        "weights= a folder whose safetensors index is no JSON",
        _garbage_index,
        ValueError,
        "model.safetensors.index.json",
    ),
    (
        "compare_strategies with a target holding autograd history",
        _target_with_history,
        ValueError,
        "use_cache=False",
    ),
    (
        "export_safetensors of a pipeline job's one-file checkpoint",
        _export_pipeline_file,
        ValueError,
        "per-rank",
    ),
]


@pytest.mark.parametrize(("name", "call", "kind", "needle"), REFUSALS, ids=[c[0] for c in REFUSALS])
def test_bad_call_is_one_clear_error(
    name: str, call: Callable[[Path], Any], kind: type[BaseException], needle: str, tmp_path: Path
) -> None:
    with pytest.raises(Exception) as info:
        call(tmp_path)
    exc = info.value
    assert isinstance(exc, kind), repr(exc)
    message = str(exc)
    assert "\n" not in message.strip(), message
    assert needle in message, message


def test_missing_shard_names_the_file_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        _missing_shard(tmp_path)
    assert "does not exist" in str(info.value) and "model.safetensors.index.json" in str(info.value)


# ----------------------------------------------------------------------------------------------- BatchNorm
@contextlib.contextmanager
def _world_of_one() -> Iterator[None]:
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _bn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))


def test_batchnorm_advice_is_a_span_option() -> None:
    with (
        _world_of_one(),
        pytest.raises(ValueError, match=r"layer '1' is BatchNorm1d: .*pass per_shard_batchnorm=True"),
    ):
        torchspan.span(_bn(), shard=True)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    reference = _bn()
    nn.functional.mse_loss(reference(x), y).backward()
    with _world_of_one():
        spanned = torchspan.span(
            _bn(), shard=True, per_shard_batchnorm=True
        )  # a world of one: the whole batch's statistics
        spanned.train_step(x, y, nn.MSELoss())
        for (name, p), q in zip(spanned.module.named_parameters(), reference.parameters()):
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            torch.testing.assert_close(grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    with pytest.raises(ValueError, match=r"per_shard_batchnorm='yes' must be True or False"):
        torchspan.span(_bn(), per_shard_batchnorm="yes")


# ----------------------------------------------------------------------------------------------- launcher
def _failure(rank: int, exitcode: int) -> SimpleNamespace:
    name = {-9: "SIGKILL", -15: "SIGTERM"}.get(exitcode, "")
    return SimpleNamespace(
        local_rank=rank,
        pid=1000 + rank,
        exitcode=exitcode,
        message="",
        timestamp=100,
        signal_name=lambda: name,
    )


def test_a_rank_the_launcher_stopped_is_not_reported_as_failed(tmp_path: Path) -> None:
    from torchspan.runtime.ranks.faults import failure_report

    (tmp_path / "attempt0").mkdir()
    report = failure_report(
        {0: _failure(0, -15), 1: _failure(1, 7), 2: _failure(2, -15)}, tmp_path, "train.py"
    )
    lines = report.splitlines()
    assert (
        lines[0] == "torchspan launch: rank 1 (local rank 1, pid 1001) of train.py failed with exit code 7"
    ), report
    assert "also failed" not in report, report
    assert "ranks 0, 2 were stopped by the launcher after rank 1 failed" in lines, report


# ------------------------------------------------------------------------------------ a DataLoader worker
@pytest.mark.parametrize("call", ["span", "shard_batch"])
def test_a_dataloader_worker_is_advised_only_what_its_call_takes(
    call: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    launched = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29533",
    }
    assert not dist.is_initialized()
    for key, value in launched.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object())
    with pytest.raises(RuntimeError, match=rf"torchspan.{call} ran in a DataLoader worker") as info:
        torchspan.span(nn.Linear(2, 2)) if call == "span" else torchspan.shard_batch(torch.zeros(4, 2))
    assert ("rank= and world_size=" in str(info.value)) == (call == "shard_batch"), str(
        info.value
    )  # span takes neither
