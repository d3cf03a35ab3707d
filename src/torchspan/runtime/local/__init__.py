"""Executors in one process: stages on this machine's devices, one worker thread per device.

Modules: ``pipelined`` (``PipelinedExecutor``: stage functions, run by ``pipeline``), ``stagefns``
(sequential/fx stage functions), ``threaded`` (``OwnForwardExecutor``: the model's own forward,
micro-batches pipelined by threads taking ``turns``), ``serial`` (``SerialExecutor``: the same, one
micro-batch after another), ``placed`` (own-forward layers and their hook placement), ``hooks``
(input-moving, timeline hooks), ``worker`` (threads, mailbox, error propagation), ``stream`` (copy
streams, transfers).

Usage: ``from torchspan.runtime.local.pipelined import PipelinedExecutor``.
"""
