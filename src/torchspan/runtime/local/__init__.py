"""Executors in one process: stages on this machine's devices, one worker thread per device.

Modules: ``pipelined`` (``PipelinedExecutor``: sequential/fx stage functions), ``hooked``
(``HookedExecutor``: hook placement), ``pipeline`` (schedule executor), ``worker`` (threads,
mailbox, error propagation), ``stream`` (copy streams, transfers), ``hooks`` (input-moving hooks).

Usage: ``from torchspan.runtime.local.pipelined import PipelinedExecutor``.
"""
