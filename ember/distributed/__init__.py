"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on CUDA).

parallel_state  rank, world size, groups; the shard layers are built for
comm            all_reduce / all_gather (timed) and the step-input broadcast
tp_config       which --tensor-parallel-size values a model can run with
mirror          rank 0's model wrappers and the workers' replay of their calls
group           rank 0: spawn / join / watch / stop the workers (and torchrun)
worker          a worker process's main loop
"""
from ember.distributed.comm import all_gather, all_reduce
from ember.distributed.parallel_state import get_tp_rank_size

__all__ = ["all_gather", "all_reduce", "get_tp_rank_size"]
