"""How the text methods' training loops split a step over processes and accumulated units.

A text method's optimizer step reads *units*: one example (EAGLE-1/2/3, DFlash), one batch of
positions or sequences (Medusa / Hydra / MTP), one token-budgeted batch (the draft LMs, PARD, S2D),
one batch of rows (SpecDec++), one sequence (Kangaroo). With P processes (``accelerate launch`` or
``torchrun``: flashmm.distributed) and ``--accumulate A``, step s reads the M = A·P units
s·M … s·M + M − 1; process r computes units s·M + r, s·M + r + P, …, each loss scaled by 1/M, and the
gradients are summed over the processes before the optimizer step (every process then holds the
same weights). So P processes with --accumulate A take exactly the steps one process takes with
--accumulate A·P (tests/test_train_parallel.py), and one process with A = 1 reads the units it read
before (unit s at step s): the recipes of the shipped drafters are unchanged.

Randomness inside a unit (EAGLE's feature noise, DFlash's anchors, PARD's drops) is drawn from a
stream seeded by the unit's index whenever M > 1 (``unit_seed``), so a unit draws the same numbers
whichever process computes it; with M = 1 the loops keep their single stream.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..distributed import ProcessGroup


@dataclass(frozen=True)
class DataParallel:
    """``accumulate`` units per process per step over the processes of ``group`` (None: this
    process alone)."""

    accumulate: int = 1
    group: ProcessGroup | None = None

    def __post_init__(self):
        if self.accumulate < 1:
            raise ValueError(f"--accumulate must be >= 1, got {self.accumulate}")

    @property
    def processes(self) -> int:
        return 1 if self.group is None else self.group.info.world_size

    @property
    def rank(self) -> int:
        return 0 if self.group is None else self.group.info.rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def per_step(self) -> int:
        """M: the units one optimizer step reads, over all processes."""
        return self.accumulate * self.processes

    def units(self, step: int) -> range:
        """The indices of the units this process computes at ``step``."""
        first = step * self.per_step
        return range(first + self.rank, first + self.per_step, self.processes)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """A unit's loss as its share of the step's (1/M of it)."""
        return loss if self.per_step == 1 else loss / self.per_step

    def unit_seed(self, seed: int, unit: int) -> int | None:
        """The seed of ``unit``'s own random stream (M > 1), or None: keep the loop's one stream."""
        return None if self.per_step == 1 else seed * 1_000_003 + unit

    def seed_unit(self, seed: int, unit: int) -> None:
        """Seed torch's and Python's global generators for ``unit`` when M > 1 (what its loss draws
        does not depend on which process computes it)."""
        chosen = self.unit_seed(seed, unit)
        if chosen is not None:
            torch.manual_seed(chosen)
            random.seed(chosen)

    def sum_gradients(self, parameters) -> None:
        """Sum the parameters' gradients over the processes (a parameter without one counts as zeros). The
        sum runs on the launch's gloo group, on the CPU: gradients on a GPU make the round trip."""
        if self.processes == 1:
            return
        params = [p for p in parameters if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params]).cpu()
        self.group.sum_(flat)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some process."""
        return bool(flag) if self.processes == 1 else bool(self.group.max(int(bool(flag))))

    def barrier(self) -> None:
        if self.group is not None:
            self.group.barrier()

    def main_first(self, build):
        """``build()`` on process 0, then on the others once it has finished: what process 0 writes
        (a corpus, a feature cache) the others read instead of writing it too."""
        if self.is_main:
            value = build()
            self.barrier()
            return value
        self.barrier()
        return build()

    def main_writes(self, write) -> None:
        """``write()`` on process 0 alone; every process goes on once it has finished."""
        if self.is_main:
            write()
        self.barrier()


ONE_PROCESS = DataParallel()
