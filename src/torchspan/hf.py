"""transformers' ``Trainer`` on torchspan: pipelines, replicas and sharding, one device's step.

``torchspan.hf.Trainer`` takes what ``transformers.Trainer`` takes plus ``span=``: the keyword arguments of
``torchspan.span`` (``devices=``, ``microbatches=``, ``schedule=``, ``shard=``, ``recompute=``, ...) or a
``Plan``. Trainer keeps its data, logging, callbacks, evaluation and checkpoints; torchspan owns placement,
the step and the reductions (as Trainer's SageMaker branch hands its step to an engine):

- **data**: every process reads the same global batches (``per_device_train_batch_size`` x data-parallel
  replicas, Trainer's own sampler and seed, as one process would read them); each replica takes its rows
  (``shard_batch``), a pipeline's stages the same rows. Evaluation runs every batch on every process.
- **the step**: ``spanned.train_step`` on the model's own loss, given ``num_items_in_batch``: the tokens (or
  labels) of the whole accumulation window over all replicas, counted as Trainer counts them, so each
  micro-step adds its exact share and the window's gradient is one device's on the global batch.
  ``max_grad_norm`` clips by the whole model's norm (``spanned.clip_grad_norm_``).
- **saving**: ``save_model`` writes one ``from_pretrained`` folder with full weights from any layout
  (sharded: gathered; a pipeline: every stage's); sharded or staged optimizer state is checkpointed
  with ``torchspan.save_checkpoint`` beside Trainer's files and read back on resume.

Usage::

    trainer = torchspan.hf.Trainer(model=model, args=args, train_dataset=ds, span={"devices": ["cpu", "cpu"],
                                   "microbatches": 2})
    trainer.train()          # python train.py, or torchspan launch --nproc-per-node 2 train.py
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch.utils._pytree import tree_map

from .planner.plans import Plan
from .runtime import Spanned
from .runtime import span as span_model
from .runtime.modelloss import shifted_tokens, tokens
from .runtime.ranks import load_checkpoint, save_checkpoint, shard_batch

__all__ = ["Trainer"]

_SPAN_KEYS = frozenset(inspect.signature(span_model).parameters) - {"model", "plan"}


def span_options(span: Any) -> tuple[Plan | None, dict[str, Any]]:
    """``(plan, keyword arguments)`` for ``torchspan.span`` from ``Trainer(span=...)``; ``ValueError`` naming
    a bad one."""
    if isinstance(span, Plan):
        return span, {}
    if span is None or span == "auto":
        return None, {}
    if not isinstance(span, Mapping):
        raise TypeError(
            f"span={span!r} is not a dict of torchspan.span keyword arguments, a torchspan.Plan or 'auto'; "
            "pass e.g. span={'devices': ['cpu', 'cpu'], 'microbatches': 2}"
        )
    unknown = sorted(set(span) - _SPAN_KEYS)
    if unknown:
        raise ValueError(
            f"span={{{', '.join(repr(k) + ': ...' for k in unknown)}}}: torchspan.span takes no "
            f"{', '.join(unknown)}; it takes {', '.join(sorted(_SPAN_KEYS))}"
        )
    options = dict(span)
    plan = options.pop("plan", None)
    return plan, options


def _check_args(args: Any, options: dict[str, Any]) -> None:
    """Trainer's own engines and torchspan's do not stack: ``ValueError`` before any work."""
    if getattr(args, "fsdp", None):
        raise ValueError(
            f"TrainingArguments(fsdp={args.fsdp!r}) with torchspan.hf.Trainer(span=...): both would shard "
            "the model. Drop fsdp= and pass span={'shard': True} (FSDP2 through torchspan), or use "
            "transformers.Trainer"
        )
    if getattr(args, "deepspeed", None):
        raise ValueError(
            "TrainingArguments(deepspeed=...) with torchspan.hf.Trainer(span=...): both would own the "
            "step. Drop deepspeed= (span={'shard': True} shards like ZeRO-3), or use transformers.Trainer"
        )
    micro = options.get("microbatches") or 1
    if isinstance(micro, int) and args.per_device_train_batch_size < micro:
        raise ValueError(
            f"per_device_train_batch_size={args.per_device_train_batch_size} < span microbatches={micro}: "
            f"each replica's batch is cut into {micro} micro-batches of one row or more. Raise the batch "
            "size or lower microbatches"
        )


def _precision(args: Any, options: dict[str, Any]) -> None:
    """``TrainingArguments(bf16=/fp16=)`` as the span's precision (its autocast and, for fp16, its own
    scaler)."""
    wanted = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    given = options.get("precision")
    if wanted and given not in (None, wanted):
        raise ValueError(
            f"TrainingArguments({wanted}=True) with span precision={given!r}: say it once, in one of them"
        )
    if wanted:
        options["precision"] = wanted


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` whose model is spanned by torchspan (see the module docstring).

    Usage: ``Trainer(model=model, args=args, train_dataset=ds, span={"shard": True}).train()``
    """

    def __init__(
        self, model: Any = None, args: Any = None, *positional: Any, span: Any = None, **kwargs: Any
    ) -> None:
        if model is None or isinstance(model, Spanned):
            got = "no model" if model is None else "a Spanned model"
            raise ValueError(
                f"torchspan.hf.Trainer got {got}: pass the plain model (model=...), and span= says how to "
                "span it; model_init is not supported"
            )
        plan, options = span_options(span)
        args = args if args is not None else transformers.TrainingArguments("tmp_trainer")
        if span == "auto":  # the planner chooses, from one batch as Trainer will cut it
            plan = _auto_plan(model, args, kwargs)
        _check_args(args, options)
        _precision(args, options)
        super().__init__(model, args, *positional, **kwargs)
        self.spanned = span_model(self.model, plan, **options)
        self.model_wrapped = self.spanned
        self.gather_function = self._metrics_of  # every process evaluates every batch: nothing to gather
        if (
            self.accelerator.scaler is not None
        ):  # fp16: the span's own scaler unscales and skips (runtime.fp16)
            self.accelerator.scaler = None

    # ------------------------------------------------------------------ data: the global batch on every
    # process
    def get_train_dataloader(self) -> Any:
        keep = self._train_batch_size
        self._train_batch_size = keep * self.spanned.data_parallel[1]
        try:
            return _whole(super().get_train_dataloader())
        finally:
            self._train_batch_size = keep

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        return _whole(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        return _whole(super().get_test_dataloader(test_dataset))

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's loop, each batch's values kept as this process holds them (Trainer resets
        ``gather_function`` to accelerate's cross-process gather at the end of every loop)."""
        self.gather_function = self._metrics_of
        return super().evaluation_loop(*args, **kwargs)

    def _metrics_of(self, value: Any) -> Any:
        """What accelerate's ``gather_for_metrics`` leaves of one process's values: the last batch's repeats
        cut."""
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            return tree_map(
                lambda t: t[: state.remainder] if isinstance(t, torch.Tensor) and t.dim() else t, value
            )
        return value

    def _get_num_items_in_batch(self, batch_samples: list[Any], device: torch.device) -> Any:
        """The labels Trainer would count over the window: every process holds the global batches, so no
        gather."""
        counts = [_count(b["labels"], self._loss_shifts_labels) for b in batch_samples if "labels" in b]
        return sum(counts) if counts else None

    # ------------------------------------------------------------------ the step
    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        return self.spanned

    def training_step(
        self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """One micro-step of the window: this replica's rows through ``spanned.train_step``, its exact
        share."""
        self.spanned.train()
        inputs = self._prepare_inputs(inputs)
        replica, replicas = self.spanned.data_parallel
        mine = shard_batch(inputs, replica, replicas) if replicas > 1 else inputs
        labels = mine.get("labels")
        if labels is None:
            raise ValueError(
                "torchspan.hf.Trainer trains on the model's own loss: each batch needs 'labels' (what a data "
                "collator such as DataCollatorForLanguageModeling adds)"
            )
        if (
            self.model_accepts_loss_kwargs and num_items_in_batch is not None
        ):  # the model divides by the window's count
            loss = self.spanned.train_step({**mine, "num_items_in_batch": int(num_items_in_batch)})
        elif self.current_gradient_accumulation_steps == 1:  # the step's mean is the window's
            loss = self.spanned.train_step(mine)
        else:
            raise ValueError(
                f"gradient_accumulation_steps={self.args.gradient_accumulation_steps} with a model whose "
                "forward takes no num_items_in_batch: torchspan.hf.Trainer cannot weigh its micro-steps "
                "exactly. Give the model's forward **kwargs (transformers models have them), or accumulate "
                "with span microbatches= instead"
            )
        return loss.detach().to(self.args.device)

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """Evaluation's loss: the batch's own mean (every process holds the whole batch; nothing to
        rescale)."""
        return super().compute_loss(model, inputs, return_outputs=return_outputs)

    def _clip_grad_norm(self, model: Any) -> Any:
        return self.spanned.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        if grad_norm is None:
            grad_norm = self.spanned.clip_grad_norm_(float("inf"))
        return grad_norm.item() if hasattr(grad_norm, "item") else grad_norm

    # ------------------------------------------------------------------ saving and resuming
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """One ``from_pretrained`` folder with the whole model's weights (a collective: call it on every
        process)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        full = full_state_dict(self.spanned)
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            self.model.save_pretrained(output_dir, state_dict=full)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not _staged(self.spanned):
            return super()._save_optimizer_and_scheduler(output_dir)
        if self.spanned.mode == "sharded":  # a folder of shards (torch.distributed.checkpoint)
            save_checkpoint(
                os.path.join(output_dir, "torchspan"),
                {"model": self.spanned, "optimizer": _bare(self.optimizer)},
            )
        else:  # a pipeline: every stage's state, one file
            state = {"model": self.spanned.state_dict(), "optimizer": _bare(self.optimizer).state_dict()}
            save_checkpoint(os.path.join(output_dir, "torchspan.pt"), state)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not _staged(self.spanned):
            return super()._load_optimizer_and_scheduler(checkpoint)
        if self.spanned.mode == "sharded":
            load_checkpoint(
                os.path.join(checkpoint, "torchspan"),
                {"model": self.spanned, "optimizer": _bare(self.optimizer)},
            )
        else:
            state = load_checkpoint(os.path.join(checkpoint, "torchspan.pt"))
            mine = {k: v for k, v in state["model"].items() if v.device.type != "meta"}  # this stage's
            self.spanned.load_state_dict(mine, strict=False)
            _bare(self.optimizer).load_state_dict(state["optimizer"])
        path = os.path.join(checkpoint, "scheduler.pt")
        if self.lr_scheduler is not None and os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """The saved folder's weights into every stage or shard (keys the model ties are its own)."""
        from safetensors.torch import load_file

        path = os.path.join(resume_from_checkpoint, "model.safetensors")
        if not os.path.isfile(path):
            raise ValueError(
                f"resume_from_checkpoint={resume_from_checkpoint!r} has no model.safetensors: "
                "torchspan.hf.Trainer resumes from the folders its own save_strategy wrote"
            )
        self.spanned.load_state_dict(_with_ties(self.spanned.module, load_file(path)))


# ---------------------------------------------------------------------- helpers


def _auto_plan(model: Any, args: Any, kwargs: dict[str, Any]) -> Plan:
    """``torchspan.plan`` on this machine's devices for one per-device batch of the training set."""
    from .planner import plan

    dataset = kwargs.get("train_dataset")
    if dataset is None:
        raise ValueError("span='auto' plans from a batch of the training set: pass train_dataset=")
    collate = kwargs.get("data_collator") or transformers.default_data_collator
    batch = collate([dataset[i] for i in range(min(args.per_device_train_batch_size, len(dataset)))])
    batch = {k: v for k, v in batch.items() if k != "labels"}
    if "use_cache" in inspect.signature(model.forward).parameters:
        batch["use_cache"] = False
    return plan(model, batch)


def _bare(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def _count(labels: torch.Tensor, shifted: bool) -> int:
    """The labels Trainer counts: not ``-100``, after the first position for a causal LM's shifted loss."""
    return int(shifted_tokens(labels) if shifted else tokens(labels))


def _whole(loader: Any) -> Any:
    """``loader`` as accelerate prepared it, but every process reading every batch (no sharding by process,
    and no samples repeated to even out the last batch: as one process reads them)."""
    sampler = getattr(loader, "batch_sampler", None)
    if sampler is not None and hasattr(sampler, "num_processes"):
        sampler.num_processes, sampler.process_index, sampler.even_batches = 1, 0, False
    return loader


def _staged(spanned: Spanned) -> bool:
    """Whether processes hold different optimizer state (sharded, or stages across ranks)."""
    return spanned.mode == "sharded" or (
        dist.is_initialized() and spanned.mode != "data-parallel" and dist.get_world_size() > 1
    )


def full_state_dict(spanned: Spanned) -> dict[str, torch.Tensor]:
    """The whole model's weights by its own keys, on every process (sharded: gathered; a pipeline: every
    stage's)."""
    state = {k: v.detach().cpu() for k, v in spanned.state_dict().items() if v.device.type != "meta"}
    if not _staged(spanned) or spanned.mode == "sharded":
        return state
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, state)
    full: dict[str, torch.Tensor] = {}
    for part in parts:
        full.update(part)
    return {k: full[k] for k in spanned.module.state_dict() if k in full}


def _with_ties(module: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each key the model ties to a saved one filled from it (safetensors drops the copy)."""
    by_tensor: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(n)
    filled = dict(state)
    for group in by_tensor.values():
        present = [n for n in group if n in state]
        for n in group:
            if n not in filled and present:
                filled[n] = state[present[0]]
    return filled
