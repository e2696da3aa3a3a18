"""Tensor parallelism's collectives over torch.distributed (gloo on CPU, NCCL on CUDA).

parallel_state  rank, world size, groups; the shard layers are built for
comm            all_reduce / all_gather (timed) and the step-input broadcast

Starting, running and stopping the workers is start-up's business (ember.engine.tp: group,
worker, mirror, config); layers only ever call the collectives here.
"""

from ember.distributed.comm import all_gather, all_reduce
from ember.distributed.parallel_state import get_tp_rank_size

__all__ = ["all_gather", "all_reduce", "get_tp_rank_size"]
