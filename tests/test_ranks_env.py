"""Launcher environments: torchrun's variables, SLURM's mapped onto them, and errors that name the values."""

from __future__ import annotations

import pytest

from torchspan.runtime.ranks import init_distributed, is_launched, launch_env

TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29511",
}
SLURM = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS_PER_NODE": "2(x2)",
    "SLURM_JOB_NODELIST": "gpu[07-08],cpu1",
    "SLURM_JOB_ID": "12345",
}


def test_not_launched() -> None:
    assert launch_env({}) is None
    assert launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None  # one task: nothing to join
    assert not is_launched({})


def test_torchrun_variables() -> None:
    assert launch_env(TORCHRUN) == TORCHRUN
    assert is_launched(TORCHRUN)
    one_node = launch_env({"RANK": "0", "WORLD_SIZE": "1"})
    assert one_node is not None and (one_node["LOCAL_RANK"], one_node["LOCAL_WORLD_SIZE"]) == ("0", "1")


def test_slurm_variables_are_mapped() -> None:
    env = launch_env(SLURM)
    assert env == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(20000 + 12345 % 20000),
    }
    assert launch_env({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "4000"})["MASTER_ADDR"] == "head"  # type: ignore[index]
    assert launch_env({**SLURM, **TORCHRUN}) == TORCHRUN  # torchrun inside an allocation wins


@pytest.mark.parametrize(
    "env, words",
    [
        ({"RANK": "0"}, "WORLD_SIZE not set but RANK is"),
        ({"WORLD_SIZE": "2"}, "RANK not set but WORLD_SIZE is"),
        ({**TORCHRUN, "RANK": "2"}, "RANK=2 must be in [0, WORLD_SIZE=2)"),
        ({**TORCHRUN, "RANK": "one"}, "RANK='one' is not an integer"),
        ({**TORCHRUN, "LOCAL_RANK": "2"}, "LOCAL_RANK=2 must be in [0, LOCAL_WORLD_SIZE=2)"),
        ({k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}, "WORLD_SIZE=2 but MASTER_PORT not set"),
        ({**TORCHRUN, "MASTER_PORT": "99999"}, "MASTER_PORT=99999 is not a TCP port"),
        ({**SLURM, "SLURM_NTASKS": "x"}, "SLURM_NTASKS='x' is not an integer"),
    ],
)
def test_inconsistent_environment_names_the_variables(env: dict[str, str], words: str) -> None:
    with pytest.raises(ValueError) as info:
        launch_env(env)
    assert words in str(info.value)


@pytest.mark.parametrize(
    "timeout, error", [(0, ValueError), (-5.0, ValueError), ("60", TypeError), (True, TypeError)]
)
def test_bad_timeout_is_refused_before_anything_starts(timeout: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="timeout="):
        init_distributed(timeout=timeout)  # type: ignore[arg-type]


def test_bad_backend_is_refused() -> None:
    with pytest.raises(TypeError, match="backend=3"):
        init_distributed(backend=3)  # type: ignore[arg-type]


def test_init_distributed_closes_its_gloo_group_at_exit(tmp_path) -> None:
    """A gloo group left to the interpreter's teardown can abort a clean process (SIGABRT), which a
    launcher counts as a failed rank: the group init_distributed opened is destroyed at exit."""
    import subprocess
    import sys

    script = tmp_path / "exits.py"
    script.write_text(
        "import atexit, torch.distributed as dist\n"
        "from torchspan.runtime.ranks import init_distributed\n"
        "init_distributed(timeout=30)\n"
        # runs before ours (LIFO)
        "atexit.register(lambda: print('initialized at exit:', dist.is_initialized()))\n"
    )
    env = {
        k: v
        for k, v in __import__("os").environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "initialized at exit: True" in done.stdout
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import atexit, torch.distributed as dist\n"
        # runs after ours (LIFO)
        "atexit.register(lambda: print('initialized after ours:', dist.is_initialized()))\n"
        "from torchspan.runtime.ranks import init_distributed\n"
        "init_distributed(timeout=30)\n"
    )
    done = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "initialized after ours: False" in done.stdout
