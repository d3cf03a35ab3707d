"""``torchspan plan TARGET --input-shape 32,512``: profile a model and print (or save) its plan.

TARGET is ``package.module:factory`` or ``path/to/file.py:factory`` returning the model. Examples::

    torchspan plan mymodels:build --input-shape 32,512 --devices cuda:0,cpu --memory cuda:0=8GiB
    torchspan plan train.py:make_model --input-shape 8,128 --input-dtype int64 \\
        --devices "a100-40gb*2,cpu" --json
    torchspan plan train.py:make_model --input-shape 32,512 --out plan.json
    torchspan plan train.py:gpt2 --input input_ids=8,128:int64 --input attention_mask=8,128:int64 \\
        --vocab 2 --devices cpu,cpu
    torchspan plan train.py:make_model --input-shape 64,512 --nodes 2 --devices "h100-80gb*8" \\
        --interconnect ib-400g
    torchspan plan examples/models.py:llama_7b --input input_ids=8,2048:int64 --vocab 32000 --nodes 2 \\
        --devices "h100-80gb*8"

When every device is described (catalog names such as h100-80gb; no cpu or auto), the model is built on the
meta device (shapes only: no memory, no compute) and profiled from FLOP estimates, so a model larger than this
machine's memory plans in seconds. A cluster plan compares replicas, sharded, sharded + offload, pipeline,
hybrid and pipeline x sharded and prints the comparison.
"""

from __future__ import annotations

import argparse

from ._cluster import add_cluster_options, cluster_kwargs
from ._common import UsageError, parse_memory_options, print_json
from ._common import parse_dtype as _dtype
from ._common import parse_microbatches as _microbatches
from ._options import (
    add_devices_option,
    add_json_option,
    add_memory_option,
    add_microbatches_option,
    add_out_option,
    add_recompute_option,
    add_schedule_option,
    add_target_arguments,
)
from ._target import build_model, example_inputs, first_call, model_dtype


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="place a model's layers on devices within memory budgets",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_target_arguments(p, "a floating dtype given to an input also profiles the model cast to it")
    add_devices_option(
        p, "plan for these devices, this machine's (auto) or described ('a100-40gb*2,cpu')", default="auto"
    )
    add_memory_option(p)
    p.add_argument(
        "--optimizer",
        default="adam",
        help="optimizer whose state to budget: sgd, sgd-momentum, adam, adamw, ... (default adam)",
    )
    add_microbatches_option(p, auto=True, default="auto")
    add_schedule_option(p, default="auto")
    add_recompute_option(p, default="auto")
    add_cluster_options(p)
    p.add_argument(
        "--host-memory",
        default=None,
        metavar="SIZE",
        help="host memory of one node for offloaded states, e.g. 2TiB (default: this machine's free memory "
        "for present "
        "devices, 3 x a node's accelerator memory for described ones)",
    )
    add_json_option(p, "the plan")
    add_out_option(p, "FILE", "the plan as JSON, atomically, as well as printing it,")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..planner import plan

    dtype = _dtype(args.dtype)
    if args.vocab < 1:
        raise UsageError(f"--vocab {args.vocab} must be >= 1 (token ids are drawn from [0, VOCAB))")
    microbatches = _microbatches(args.microbatches)
    memory = parse_memory_options(args.memory)
    host_memory = _host_memory(args.host_memory)
    if args.out:
        _prepare_out(args.out)
    model = build_model(args.target, meta=_all_described(args.devices, memory))
    example, _, _ = example_inputs(args.input_shape, args.input, dtype, args.vocab, "--dtype")
    profile_dtype = model_dtype(dtype, example)  # integer inputs only: the model's own dtype
    if profile_dtype is not None:
        model.to(profile_dtype)  # profiled as if cast to it anyway; the first call needs it
    first_call(model, example, "--input" if args.input else "--input-shape/--dtype", vocab=args.vocab)
    result = plan(
        model,
        example,
        devices=args.devices,
        memory=memory,
        microbatches=microbatches,
        schedule=args.schedule,
        recompute=args.recompute,
        optimizer=args.optimizer,
        dtype=profile_dtype,
        host_memory=host_memory,
        **cluster_kwargs(args),
    )
    if args.out:
        result.save(args.out)
    if args.json:
        print_json(result.to_dict())
    else:
        print(result)
        if args.out:
            print(f"plan written to {args.out}")
    return 0


def _all_described(devices: str, memory: dict[str, str] | None) -> bool:
    """True when every device of ``--devices`` is described (a catalog device), none present: the model is
    then built on ``meta``. A spec ``torchspan.devices`` refuses is left for the plan to name."""
    from ..hardware import devices as find_devices

    try:
        found = find_devices(devices, memory)
    except ValueError:
        return False
    return bool(found) and not any(d.present for d in found)


def _host_memory(value: str | None) -> int | None:
    """``--host-memory SIZE`` in bytes (None when not given); a bad size is a ``UsageError``."""
    if value is None:
        return None
    from ..hardware import parse_memory

    try:
        return parse_memory(value, name="--host-memory")
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _prepare_out(out: str) -> None:
    """Check ``--out`` before the (slow) profiling: a regular file or nothing there (a link's target counts),
    in a writable folder; create the folder if missing."""
    from ..files import output_file

    output_file(out, name="--out", make_parent=True, example="plan.json")
