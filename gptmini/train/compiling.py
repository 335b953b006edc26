"""Why a compiled training run repeats to the bit, and the switch that makes it so.

On a CPU, torch.compile (inductor) lowers the token embedding's backward, a scatter-add of
every position's gradient into the row of its token, to a parallel loop of atomic adds
(`atomic_add_vec` under `#pragma omp for`). With two OpenMP threads, two positions of one
token add into its row in whichever order the threads get there, and float addition does
not associate: the embedding's gradient differs in its last bits from run to run, and the
optimizer carries that into every weight. Issue 48 found 14 of 14 tensors different after
300 steps of two identical runs (and after a stop and resume); one thread, or the eager
model, whose CPU kernels add in a fixed order, gave identical weights.

torch's switch is `torch.use_deterministic_algorithms`: inductor reads it when it lowers a
graph and then calls aten's `index_put_` for such scatter-adds, whose CPU kernel adds in
order (pytorch/pytorch#93537). It must hold while the backward is lowered too, which
happens lazily at the first `backward()`, and dynamo guards on it (a change recompiles), so
`deterministic_kernels` holds it for the whole of `fit` (the model is compiled in
`GPTLitModule.configure_model`; under fsdp2 each block, in `shard_model`). What it cost,
measured: docs/training.md ("Exact resume").
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["deterministic_kernels"]


@contextmanager
def deterministic_kernels(device: torch.device | str, enabled: bool = True) -> Iterator[None]:
    """While the block runs, compiled CPU kernels add in a fixed order (see the module's
    docstring), so the same seed, command and thread count give the same weights.

    Elsewhere (a GPU) nothing changes: torch's deterministic mode there also needs
    CUBLAS_WORKSPACE_CONFIG before CUDA starts, which Lightning's `--trainer.deterministic
    true` sets. Ops that have no deterministic kernel warn rather than stop the run. The
    mode's other effect, filling every new tensor with NaN to expose reads of memory never
    written, is a debugging aid that writes each buffer once more: it stays off.
    """
    if not enabled or torch.device(device).type != "cpu":
        yield
        return
    fill = torch.utils.deterministic
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(), fill.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=before[1] or not before[0])
    fill.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        fill.fill_uninitialized_memory = before[2]
