"""Tensor and pipeline parallelism over worker processes (torch.distributed): see docs/distributed.md."""
from llmc.runtime.distributed.executor import DistributedExecutor

__all__ = ["DistributedExecutor"]
