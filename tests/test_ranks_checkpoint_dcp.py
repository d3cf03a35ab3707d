"""Sharded checkpoints on ``torch.distributed.checkpoint`` (issue 20 item 4).

Two gloo ranks train a sharded, tied Llama (float64) one AdamW step and save ``{"model": spanned, "optimizer":
opt, "step": 1, ...}`` as a folder, each rank writing its shards; they record the full weights and optimizer
state (rank 0, a reference file) after that step and after an uninterrupted second step. Then:

- a fresh job of 2 ranks and one of 4 (DCP reshards) load it into a differently-initialised model, find the
saved
  weights and optimizer state, and take the second step: the uninterrupted run's weights;
- one plain process (no process group) reads it as full tensors with the model's own keys, equal to the saved
  weights, and loads it into a plain Llama + AdamW that takes the same second step;
- a save that fails on one rank mid-write (rank 1's writer raises), and a job SIGKILLed while rank 1 writes,
  leave the previous checkpoint whole and loadable; the killed job's temporary folder is removed by the load;
- ``export_safetensors`` writes one ``model.safetensors`` (the tie written once) + ``config.json`` that
  ``LlamaForCausalLM.from_pretrained`` loads to the saved weights.

One process: the folder swap where the filesystem cannot exchange (and its recovery after a crash between
its two renames), the safe loader (``.metadata``, values and optimizer values that need other objects are
refused unless ``trusted=True``), refusals, the older ``load_checkpoint(path, map_location)`` form, a folder
written by ``dcp.save`` itself, safetensors missing.
"""

from __future__ import annotations

import errno
import os
import pickle
import signal
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_ranks_pipeline import _leave, _spawn
from torch import nn
from torch.utils._pytree import tree_map

import torchspan
from torchspan import files
from torchspan.runtime.ranks import (
    export_safetensors,
    free_port,
    load_checkpoint,
    save_checkpoint,
    shard_batch,
)

transformers = pytest.importorskip("transformers")

EXACT = dict(rtol=0, atol=0)
CLOSE = dict(
    rtol=1e-6, atol=1e-9
)  # another world size sums the gradients in another order; the own loss is float32


def _llama(seed: int = 0) -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=32,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).double()


def _batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 64, (5, 9), generator=g)
    labels = ids.clone()
    labels[1, :3] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _full_state(spanned: torchspan.Spanned, opt: torch.optim.Optimizer) -> dict[str, dict]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True)
    state = {
        "model": spanned.state_dict(),
        "optimizer": get_optimizer_state_dict(spanned.module, opt, options=full),
    }
    return tree_map(
        lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state
    )  # a step counter is shared


def _same(got: dict, want: dict, label: str, **tol: float) -> None:
    assert list(got["model"]) == list(want["model"]), label
    for key, value in want["model"].items():
        torch.testing.assert_close(got["model"][key], value, **tol, msg=lambda m: f"{label}: {key}: {m}")
    assert set(got["optimizer"]["state"]) == set(want["optimizer"]["state"]), label
    for name, moments in want["optimizer"]["state"].items():
        for slot, value in moments.items():
            torch.testing.assert_close(
                got["optimizer"]["state"][name][slot],
                value,
                **tol,
                msg=lambda m: f"{label}: {name}.{slot}: {m}",
            )


def _step(spanned: torchspan.Spanned, opt: torch.optim.Optimizer, step: int, rank: int, world: int) -> float:
    opt.zero_grad()
    loss = spanned.train_step(shard_batch(_batch(step), rank, world))
    opt.step()
    return float(loss)


def _verdict(folder: str, name: str, rank: int, case) -> None:  # type: ignore[no-untyped-def]
    try:
        case()
        text = "ok"
    except BaseException:
        text = "FAILED " + traceback.format_exc()
    Path(folder, f"{name}.rank{rank}.txt").write_text(text)


def _verdicts(folder: Path, name: str, world: int) -> None:
    for rank in range(world):
        path = folder / f"{name}.rank{rank}.txt"
        assert path.exists(), f"rank {rank} wrote no verdict for {name}"
        assert path.read_text() == "ok", f"rank {rank}:\n{path.read_text()}"


def _join(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    torchspan.init_distributed(timeout=60)


# ------------------------------------------------------------------------------------------ the saving job


def _save_job(rank: int, world: int, port: int, folder: str) -> None:
    _join(rank, world, port)
    ckpt = Path(folder, "ckpt")
    spanned = torchspan.span(_llama(0), shard=True)
    opt = torch.optim.AdamW(spanned.parameters(), lr=0.01)
    loss = _step(spanned, opt, 0, rank, world)

    def save() -> None:
        assert (
            load_checkpoint(ckpt, {"model": spanned, "optimizer": opt}) is None
        )  # a first start: nothing yet
        wrote = save_checkpoint(
            ckpt, {"model": spanned, "optimizer": opt, "step": 1, "losses": [loss], "note": "run-1"}
        )
        assert wrote is (rank == 0)
        assert sorted(p.name for p in ckpt.iterdir()) == [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
            "torchspan.json",
            "values.pt",
        ]

    _verdict(folder, "save", rank, save)
    after1 = _full_state(spanned, opt)
    _step(spanned, opt, 1, rank, world)  # the uninterrupted run's second step
    after2 = _full_state(spanned, opt)
    if rank == 0:
        torch.save({"after1": after1, "after2": after2}, Path(folder, "reference.pt"))

    def failed_save() -> None:
        from torch.distributed.checkpoint import FileSystemWriter

        real = FileSystemWriter.write_data

        def half_written(self, plan, planner):  # type: ignore[no-untyped-def]
            Path(self.path, "__1_0.distcp").write_bytes(b"half a shard")
            raise OSError(errno.ENOSPC, "No space left on device")

        if rank == 1:
            FileSystemWriter.write_data = half_written  # type: ignore[method-assign]
        try:
            with pytest.raises(
                RuntimeError,
                match=r"failed on rank 1 \(OSError: .*No space left on device\); nothing was replaced",
            ):
                save_checkpoint(ckpt, {"model": spanned, "optimizer": opt, "step": 2})
        finally:
            FileSystemWriter.write_data = real  # type: ignore[method-assign]
        dist.barrier()
        assert (
            sorted(p.name for p in Path(folder).iterdir() if p.name.startswith(".ckpt")) == []
        )  # no temporary left
        assert load_checkpoint(ckpt)["step"] == 1  # type: ignore[index]

    _verdict(folder, "failed_save", rank, failed_save)

    def replica() -> (
        None
    ):  # a data-parallel replica's state: every rank holds all of it, DCP writes each tensor once
        torch.manual_seed(0)
        dp = torchspan.span(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)))
        dp_opt = torch.optim.Adam(dp.parameters(), lr=0.1)
        dp.train_step(*shard_batch((torch.randn(5, 6), torch.randn(5, 3)), rank, world), nn.MSELoss())
        dp_opt.step()
        save_checkpoint(Path(folder, "dp"), {"model": dp, "optimizer": dp_opt, "step": 5})
        torch.manual_seed(1)
        fresh = torchspan.span(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)))
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
        assert load_checkpoint(Path(folder, "dp"), {"model": fresh, "optimizer": fresh_opt})["step"] == 5  # type: ignore[index]
        assert dp.mode == fresh.mode == "data-parallel"
        for (name, p), q in zip(dp.module.named_parameters(), fresh.module.parameters()):
            torch.testing.assert_close(q, p, **EXACT, msg=lambda m: f"{name}: {m}")
            torch.testing.assert_close(fresh_opt.state[q]["exp_avg"], dp_opt.state[p]["exp_avg"], **EXACT)

    _verdict(folder, "replica", rank, replica)
    _leave()


# ----------------------------------------------------------------------------------------- the loading jobs


def _resume_job(rank: int, world: int, port: int, folder: str) -> None:
    _join(rank, world, port)
    reference = torch.load(Path(folder, "reference.pt"), weights_only=True)

    def resume() -> None:
        spanned = torchspan.span(
            _llama(1), shard=True
        )  # other weights: the checkpoint must bring the saved ones
        opt = torch.optim.AdamW(
            spanned.parameters(), lr=0.5
        )  # another lr: the saved param_groups come back too
        state = load_checkpoint(Path(folder, "ckpt"), {"model": spanned, "optimizer": opt})
        assert state is not None and state["model"] is spanned and state["optimizer"] is opt
        assert (state["step"], state["note"], list(state)) == (
            1,
            "run-1",
            ["model", "optimizer", "step", "losses", "note"],
        )
        assert opt.param_groups[0]["lr"] == 0.01
        _same(_full_state(spanned, opt), reference["after1"], f"loaded by {world} ranks", **EXACT)
        _step(spanned, opt, 1, rank, world)
        _same(
            _full_state(spanned, opt),
            reference["after2"],
            f"second step on {world} ranks",
            **(EXACT if world == 2 else CLOSE),
        )

    _verdict(folder, f"resume{world}", rank, resume)
    _leave()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("dcp")
    _spawn(_save_job, 2, free_port(), str(folder), deadline=300.0)
    return folder


@pytest.mark.slow
def test_two_sharded_ranks_save_every_shard_into_one_folder(saved: Path) -> None:
    _verdicts(saved, "save", 2)


@pytest.mark.slow
def test_a_save_failing_on_one_rank_keeps_the_previous_checkpoint(saved: Path) -> None:
    _verdicts(saved, "failed_save", 2)


@pytest.mark.slow
def test_a_data_parallel_replica_saves_and_loads_the_same_way(saved: Path) -> None:
    _verdicts(saved, "replica", 2)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_a_fresh_job_resumes_as_the_uninterrupted_run(saved: Path, world: int) -> None:
    _spawn(_resume_job, world, free_port(), str(saved), deadline=400.0)
    _verdicts(saved, f"resume{world}", world)


@pytest.mark.slow
def test_one_plain_process_reads_full_tensors_and_continues(saved: Path) -> None:
    reference = torch.load(saved / "reference.pt", weights_only=True)
    assert not dist.is_initialized()
    full = load_checkpoint(saved / "ckpt")
    assert full is not None and list(full) == ["model", "optimizer", "step", "losses", "note"]
    assert list(full["model"]) == list(_llama().state_dict())  # the model's own keys, lm_head.weight included
    assert all(type(v) is torch.Tensor for v in full["model"].values())
    _same(full, reference["after1"], "read in one process", **EXACT)
    assert full["optimizer"]["param_groups"][0]["lr"] == 0.01 and full["step"] == 1

    model = _llama(1)  # a plain model and optimizer in this process, no process group
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    state = load_checkpoint(saved / "ckpt", {"model": model, "optimizer": opt})
    assert state is not None and state["step"] == 1 and not dist.is_initialized()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for key, value in reference["after1"]["model"].items():
        torch.testing.assert_close(model.state_dict()[key], value, **EXACT)
    opt.zero_grad()
    model(**_batch(1)).loss.backward()
    opt.step()
    for key, value in reference["after2"]["model"].items():
        torch.testing.assert_close(
            model.state_dict()[key], value, **CLOSE, msg=lambda m: f"one process, second step: {key}: {m}"
        )


@pytest.mark.slow
def test_export_to_safetensors_loads_with_from_pretrained(saved: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    reference = torch.load(saved / "reference.pt", weights_only=True)["after1"]["model"]
    out = export_safetensors(saved / "ckpt", tmp_path / "hf")
    assert out == tmp_path / "hf" / "model.safetensors"
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(out, "pt") as f:
        keys = set(f.keys())
        assert f.metadata() == {"format": "pt"}
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys  # the tie written once
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert list(model.state_dict()) == list(reference)
    for key, value in reference.items():
        torch.testing.assert_close(model.state_dict()[key], value, **EXACT, msg=lambda m: f"{key}: {m}")


# ------------------------------------------------------------------------------------ a job killed mid-save


def _killed_job(rank: int, world: int, port: int, folder: str) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    _join(rank, world, port)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    spanned = torchspan.span(model, shard=True)
    opt = torch.optim.Adam(spanned.parameters(), lr=0.1)
    save_checkpoint(Path(folder, "ckpt"), {"model": spanned, "optimizer": opt, "step": 1})
    first = spanned.state_dict()  # gathered: every rank takes part
    if rank == 0:
        torch.save(first, Path(folder, "first.pt"))
    spanned.train_step(torch.randn(4, 6), torch.randn(4, 3), nn.MSELoss())
    opt.step()
    real = FileSystemWriter.write_data

    def stalled(self, plan, planner):  # type: ignore[no-untyped-def]
        Path(self.path, "__1_0.distcp").write_bytes(b"part of a shard")
        Path(folder, "writing").write_text(str(self.path))
        time.sleep(600)  # killed here
        return real(self, plan, planner)

    if rank == 1:
        FileSystemWriter.write_data = stalled  # type: ignore[method-assign]
    save_checkpoint(Path(folder, "ckpt"), {"model": spanned, "optimizer": opt, "step": 2})


@pytest.mark.slow
def test_a_job_killed_mid_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    ctx = mp.start_processes(
        _killed_job, args=(2, free_port(), str(tmp_path)), nprocs=2, join=False, start_method="spawn"
    )
    start = time.monotonic()
    while not (tmp_path / "writing").exists():
        assert time.monotonic() - start < 180, "rank 1 never reached the second save"
        assert all(p.is_alive() for p in ctx.processes), "a rank ended before the second save"
        time.sleep(0.2)
    for p in ctx.processes:
        os.kill(p.pid, signal.SIGKILL)
    for p in ctx.processes:
        p.join(30)
    temporary = Path((tmp_path / "writing").read_text())
    assert (
        temporary.is_dir() and temporary.name.startswith(".ckpt.torchspan.") and temporary.parent == tmp_path
    )
    state = load_checkpoint(tmp_path / "ckpt")
    assert state is not None and state["step"] == 1
    for key, value in torch.load(tmp_path / "first.pt", weights_only=True).items():
        torch.testing.assert_close(state["model"][key], value, **EXACT)
    assert not temporary.exists()  # its writer is dead: removed by the load


# ------------------------------------------------------------------------------------------- one process


def _plain(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    return model, opt


def test_one_process_saves_and_loads_objects_in_place(tmp_path: Path) -> None:
    model, opt = _plain(0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    assert (
        save_checkpoint(tmp_path / "ckpt", {"model": model, "optimizer": opt, "sched": sched, "step": 4})
        is True
    )
    other, other_opt = _plain(1)
    other_sched = torch.optim.lr_scheduler.StepLR(other_opt, step_size=9)
    state = load_checkpoint(tmp_path / "ckpt", {"model": other, "optimizer": other_opt, "sched": other_sched})
    assert state == {"model": other, "optimizer": other_opt, "sched": other_sched, "step": 4}
    assert other_sched.step_size == 3 and torch.equal(other[0].weight, model[0].weight)
    torch.testing.assert_close(
        other_opt.state[other[2].bias]["exp_avg"], opt.state[model[2].bias]["exp_avg"], **EXACT
    )
    full = load_checkpoint(tmp_path / "ckpt", "cpu")  # the older positional map_location still works
    assert (
        full is not None
        and full["sched"]["step_size"] == 3
        and list(full["model"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    )


def test_a_save_that_fails_keeps_the_previous_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    model, opt = _plain(0)
    save_checkpoint(tmp_path / "ckpt", {"model": model, "optimizer": opt, "step": 1})

    def crash(self, plan, planner):  # type: ignore[no-untyped-def]
        Path(self.path, "__0_0.distcp").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", crash)
    with pytest.raises(RuntimeError, match="No space left on device.*nothing was replaced"):
        save_checkpoint(tmp_path / "ckpt", {"model": model, "optimizer": opt, "step": 2})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert load_checkpoint(tmp_path / "ckpt")["step"] == 1  # type: ignore[index]


def test_the_swap_without_an_exchange_and_its_recovery(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _plain(0)
    save_checkpoint(tmp_path / "ckpt", {"model": model, "step": 1})
    monkeypatch.setattr(
        files, "_exchange", lambda a, b: False
    )  # a filesystem without renameat2(RENAME_EXCHANGE)
    save_checkpoint(tmp_path / "ckpt", {"model": model, "step": 2})
    assert (
        sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
        and load_checkpoint(tmp_path / "ckpt")["step"] == 2
    )  # type: ignore[index]

    real_rename = os.rename

    def die_between(src, dst):  # type: ignore[no-untyped-def]
        real_rename(src, dst)
        if str(dst).endswith(".old"):
            raise KeyboardInterrupt  # the writer dies right after moving the previous folder aside

    monkeypatch.setattr(os, "rename", die_between)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "ckpt", {"model": model, "step": 3})
    monkeypatch.undo()
    aside = [p for p in tmp_path.iterdir() if p.name.endswith(".old")]
    assert not (tmp_path / "ckpt").exists() and len(aside) == 1
    dead = aside[0].with_name(
        aside[0].name.replace(f".{os.getpid()}.", ".999999999.", 1)
    )  # as a dead writer left it
    aside[0].rename(dead)
    # the previous folder renamed back
    assert load_checkpoint(tmp_path / "ckpt")["step"] == 2  # type: ignore[index]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


class Evil:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("echo pwned > /dev/null",))


class Custom:
    pass


def test_the_safe_loader_refuses_objects_unless_trusted(tmp_path: Path) -> None:
    model, opt = _plain(0)
    with pytest.warns(
        UserWarning, match="holds .*Custom: load_checkpoint refuses such objects unless trusted=True"
    ):
        save_checkpoint(tmp_path / "values", {"model": model, "custom": Custom()})
    with pytest.raises(ValueError, match=r"needs .*Custom.*load_checkpoint\(.*values', trusted=True\)"):
        load_checkpoint(tmp_path / "values")
    assert isinstance(load_checkpoint(tmp_path / "values", trusted=True)["custom"], Custom)  # type: ignore[index]

    opt.param_groups[0]["note"] = Custom()  # an optimizer value is read through DCP's bytes
    save_checkpoint(tmp_path / "group", {"model": model, "optimizer": opt})
    with pytest.raises(
        ValueError, match=r"needs .*Custom \(in optimizer.param_groups.0.note\).*trusted=True"
    ):
        load_checkpoint(tmp_path / "group")
    fresh, fresh_opt = _plain(1)
    fresh_opt.param_groups[0]["note"] = Custom()  # loaded into only where the optimizer has that key
    with pytest.raises(ValueError, match=r"needs .*Custom .*trusted=True"):
        load_checkpoint(tmp_path / "group", {"model": fresh, "optimizer": fresh_opt})
    assert load_checkpoint(tmp_path / "group", trusted=True) is not None

    del opt.param_groups[0]["note"]
    save_checkpoint(tmp_path / "meta", {"model": model})
    metadata = tmp_path / "meta" / ".metadata"
    metadata.write_bytes(pickle.dumps(Evil()))
    with pytest.raises(ValueError, match=r"needs posix.system \(in its .metadata\).*trusted=True"):
        load_checkpoint(tmp_path / "meta")
    metadata.write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="the folder's .metadata is corrupt or truncated"):
        load_checkpoint(tmp_path / "meta")


def test_refusals(tmp_path: Path) -> None:
    model, opt = _plain(0)
    torch.save({"step": 1}, tmp_path / "file.pt")
    with pytest.raises(ValueError, match="is a file .a one-file checkpoint.; a state holding a model"):
        save_checkpoint(tmp_path / "file.pt", {"model": model})
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_bytes(b"")
    with pytest.raises(ValueError, match="is a folder of other files, not a sharded checkpoint"):
        save_checkpoint(tmp_path / "photos", {"model": model})
    with pytest.raises(ValueError, match="does not exist; create it first"):
        save_checkpoint(tmp_path / "missing" / "ckpt", {"model": model})
    with pytest.raises(ValueError, match="the optimizer under 'opt' holds none of the models in the state"):
        save_checkpoint(tmp_path / "ckpt", {"model": nn.Linear(2, 2), "opt": opt})
    with torch.device("meta"):
        stage = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="holds meta tensors .a pipeline rank holds only its stage."):
        save_checkpoint(tmp_path / "ckpt", {"model": stage})
    with pytest.raises(ValueError, match="writer=1: a sharded checkpoint is written by every rank"):
        save_checkpoint(tmp_path / "ckpt", {"model": model}, writer=1)  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "file.pt",
        "photos",
    ]  # nothing written, no temporary
    save_checkpoint(tmp_path / "ckpt", {"model": model})
    with pytest.raises(ValueError, match=r"the checkpoint has no 'optimizer' \(it holds 'model'\)"):
        load_checkpoint(tmp_path / "ckpt", {"model": model, "optimizer": opt})
    with pytest.raises(ValueError, match="is a folder, not a checkpoint file"):
        load_checkpoint(tmp_path / "photos")


def test_a_folder_written_by_dcp_itself_loads(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model, _ = _plain(0)
    with pytest.warns(UserWarning):
        dcp.save({"model": model.state_dict(), "epoch": 3}, checkpoint_id=tmp_path / "raw")
    full = load_checkpoint(tmp_path / "raw")
    assert full is not None and full["epoch"] == 3 and torch.equal(full["model"]["0.weight"], model[0].weight)
    other, _ = _plain(1)
    assert load_checkpoint(tmp_path / "raw", {"model": other})["model"] is other  # type: ignore[index]
    assert torch.equal(other[0].weight, model[0].weight)


def test_export_refuses_without_safetensors_and_exports_a_file_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            tie_word_embeddings=True,
        )
    )
    save_checkpoint(tmp_path / "ckpt.pt", {"model": model.state_dict(), "step": 1})
    monkeypatch.setitem(__import__("sys").modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r"pip install safetensors"):
        export_safetensors(tmp_path / "ckpt.pt", tmp_path / "hf")
    monkeypatch.undo()
    export_safetensors(tmp_path / "ckpt.pt", tmp_path / "hf", config=model.config)
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    for key, value in model.state_dict().items():
        torch.testing.assert_close(back.state_dict()[key], value, **EXACT)
