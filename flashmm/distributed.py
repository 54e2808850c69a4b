"""Which process of a multi-process launch this is, and a barrier between the processes.

``accelerate launch`` (through torch's elastic launcher) and ``torchrun`` start one copy of the
program per process and tell each its place in environment variables: RANK (0..WORLD_SIZE-1
over all machines), WORLD_SIZE, LOCAL_RANK (0.. on this machine), MASTER_ADDR / MASTER_PORT
(where rank 0 listens). Nothing here needs accelerate: a plain ``python`` run is process 0 of 1.

The barrier runs on its own gloo process group (CPU, TCP), whatever the device, so processes
that wait for the slowest shard hold no GPU collective, and its timeout is long (``BARRIER_TIMEOUT``):
a shard of videos may finish hours after a shard of images.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

BARRIER_TIMEOUT = datetime.timedelta(days=7)


@dataclass(frozen=True)
class ProcessInfo:
    """rank: this process over all machines (0..world_size-1); local_rank: on this machine."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer; launch with "
                         "accelerate launch or torchrun, which set RANK / WORLD_SIZE / LOCAL_RANK") from None


def process_info() -> ProcessInfo:
    """This process's place, from the launcher's environment (process 0 of 1 without one)."""
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is not in 0..WORLD_SIZE-1 (WORLD_SIZE={world_size})")
    return ProcessInfo(rank=rank, world_size=world_size, local_rank=local_rank)


def launched_without_gpu() -> bool:
    """A multi-process launch on a machine without CUDA. accelerate (1.15) only starts its gloo
    process group there when told ``cpu=True``: ``accelerate launch --cpu`` starts ONE process,
    and ``accelerate launch --multi_gpu --num_processes N`` on a CPU machine starts N processes
    that each see themselves as the only one. Pass this as ``Accelerator(cpu=...)``."""
    import torch

    return process_info().is_distributed and not torch.cuda.is_available()


def local_device(device: str | None, info: ProcessInfo) -> str | None:
    """The device this process should use for ``device`` (a --device value, None: the default).
    Under a multi-process launch on a CUDA machine, None and "cuda" mean this process's own GPU,
    cuda:LOCAL_RANK (mod the GPUs visible); anything else is kept as given."""
    import torch

    if not info.is_distributed or device not in (None, "cuda") or not torch.cuda.is_available():
        return device
    return f"cuda:{info.local_rank % torch.cuda.device_count()}"


class ProcessGroup:
    """A gloo group over every process of the launch (``None``-like no-op for a single process).

        group = ProcessGroup.start(info)     # every process, before work starts
        ...
        group.barrier()                      # every process waits for the slowest
        worst = group.max(status)            # the largest value over processes (also a barrier)
        group.sum_(tensor)                   # a CPU tensor summed over processes, in place
        group.close()
    """

    def __init__(self, info: ProcessInfo, handle=None, owned: bool = False):
        self.info, self._handle, self._owned = info, handle, owned

    @classmethod
    def start(cls, info: ProcessInfo | None = None) -> ProcessGroup:
        info = info or process_info()
        if not info.is_distributed:
            return cls(info)
        import torch.distributed as dist

        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        if missing:
            raise RuntimeError(f"WORLD_SIZE={info.world_size} but {', '.join(missing)} not set: start the "
                               "processes with accelerate launch or torchrun, which set them")
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=BARRIER_TIMEOUT, rank=info.rank, world_size=info.world_size)
            return cls(info, None, owned=True)
        # someone else (e.g. accelerate, maybe with NCCL) made the default group: a gloo group beside it
        return cls(info, dist.new_group(backend="gloo", timeout=BARRIER_TIMEOUT))

    def barrier(self) -> None:
        if self.info.is_distributed:
            import torch.distributed as dist

            dist.barrier(group=self._handle)

    def max(self, value: int) -> int:
        """The largest ``value`` over all processes (every process gets it)."""
        if not self.info.is_distributed:
            return value
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._handle)
        return int(tensor.item())

    def sum_(self, tensor) -> None:
        """Sum ``tensor`` (a CPU tensor) over all processes, in place (every process gets the sum)."""
        if self.info.is_distributed:
            import torch.distributed as dist

            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._handle)

    def close(self) -> None:
        if self._owned:
            import torch.distributed as dist

            dist.destroy_process_group()
            self._owned = False
