"""Several processes: joining the job (``env``), sharding data (``shard``), exact data-parallel
replicas (``dataparallel``, ``replicated``), pipelines across ranks (``mesh``; ``stage``, held by
``pipelined``: stage functions over ``p2p``, and ``ownforward``: the model's own forward, with
``taint``, ``routes``, ``metacalls``, ``glue``, ``forwardstate`` and ``together``; ``stageshard``: each stage
sharded over its replicas) and checkpoints: one file written once
for all ranks, or a sharded folder every rank writes on ``torch.distributed.checkpoint`` (``checkpoint``,
``dcp``, ``dcpread``, ``checkpointio``; ``export``: one safetensors file for transformers) and the weights of
a model built on ``meta``, each rank filling only its part (``metaweights``).

Usage: ``from torchspan.runtime.ranks import init_distributed, DataParallelReplica, shard_batch``.
"""

from .checkpoint import load_checkpoint, save_checkpoint
from .dataparallel import DataParallelReplica, shard_loss
from .env import RankInfo, free_port, init_distributed, is_launched, launch_env, rank_info
from .export import export_safetensors
from .shard import rank_batches, shard_batch, shard_range, shard_sizes

__all__ = [
    "DataParallelReplica",
    "RankInfo",
    "export_safetensors",
    "free_port",
    "init_distributed",
    "is_launched",
    "launch_env",
    "load_checkpoint",
    "rank_batches",
    "rank_info",
    "save_checkpoint",
    "shard_batch",
    "shard_loss",
    "shard_range",
    "shard_sizes",
]
