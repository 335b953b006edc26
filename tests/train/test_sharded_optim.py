"""Muon under FSDP2: the step on row shards equals the step on whole matrices (the
orthogonalized update of the whole matrix, not of each shard), on two gloo processes."""

import math

import pytest
import torch
from helpers import HostReads, make_model, run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from gptmini.model import lm_loss
from gptmini.train.muon import muon_adamw, orthogonalize, sharded_orthogonalize
from gptmini.train.steps import clip_gradients

RATES = dict(learning_rate=3e-3, muon_learning_rate=5e-3, weight_decay=0.1, betas=(0.9, 0.95))
CPU = torch.device("cpu")
pytestmark = pytest.mark.slow  # two processes started, a few seconds each
# Uneven on purpose: 5 and 7 rows split 3+2 and 4+3; one row leaves rank 1 none; three
# matrices of one shape need a padding matrix for two owners; 7 x 5 is tall.
SHAPES = [(5, 7), (5, 7), (5, 7), (7, 5), (1, 4), (6, 6)]


def matrices() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def sharded_rows(mesh) -> list[torch.Tensor]:
    params = [distribute_tensor(m, mesh, [Shard(0)]) for m in matrices()]
    done = sharded_orthogonalize(params, [p.to_local() for p in params], "polar_express")
    return [d.float() for d in done]


def on_each_rank(rank: int, world: int) -> dict:
    """What the tests below compare, from one launch of two processes (each costs seconds)."""
    mesh = init_device_mesh("cpu", (world,))
    return {"rows": sharded_rows(mesh), "weights": sharded_training(mesh)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(on_each_rank, 2, tmp_path_factory.mktemp("ranks"))


def test_sharded_orthogonalize_gives_each_rank_its_rows_of_the_whole_update(ranks):
    ranks = [r["rows"] for r in ranks]
    for i, matrix in enumerate(matrices()):
        whole = orthogonalize(matrix[None], "polar_express")[0].float()
        got = torch.cat([rows[i] for rows in ranks])
        assert torch.equal(got, whole), SHAPES[i]
        # not the shards' own orthogonalization: that is another matrix
        if matrix.size(0) > 1:
            first = orthogonalize(matrix[None, :-(-matrix.size(0) // 2)], "polar_express")[0]
            assert not torch.allclose(ranks[0][i], first.float(), atol=1e-2)


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (4, 9), generator=generator) for _ in range(4)]


def train(model, optimizer) -> list[str]:
    """Four steps, the third's gradients NaN and skipped on the device (found_inf), each
    clipped, the skip decided and stepped as a run does; the host's reads of tensor values
    in those (HostReads: on a GPU, each would wait for it)."""
    reads = HostReads()
    for step, batch in enumerate(batches()):
        lm_loss(model, batch[:, :-1], batch[:, 1:]).backward()
        if step == 2:
            for p in model.parameters():
                (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).fill_(math.nan)
        with reads:
            norm = clip_gradients(list(model.parameters()), 1e9, "norm")
            optimizer.found_inf = torch.where(torch.isfinite(norm), 0.0, 1.0)
            optimizer.step()
        optimizer.zero_grad()
    return reads.seen


def sharded_training(mesh) -> dict[str, torch.Tensor]:
    """Every rank the whole batch: FSDP2's averaged gradients are the unsharded ones."""
    torch.manual_seed(0)
    model = make_model(qkv_bias=True).train()
    for block in model.trf_blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = muon_adamw(model, **RATES, device=CPU)
    assert train(model, optimizer) == [], "a sharded step read a value off the device"
    states = optimizer.state_dict()["state"]
    assert all(isinstance(v, DTensor) for s in states.values() for k, v in s.items()
               if k != "step"), "the states are DTensors, sharded as the parameters"
    return {name: p.full_tensor() for name, p in model.named_parameters()}


def test_muon_on_two_ranks_of_fsdp2_steps_as_on_one_process_bit_for_bit(ranks):
    # on one thread, as run_ranks' processes train: two threads split the embedding's
    # backward sums otherwise (tok_emb differed where OMP_NUM_THREADS was unset)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = make_model(qkv_bias=True).train()
        train(model, muon_adamw(model, **RATES, device=CPU))
    finally:
        torch.set_num_threads(threads)
    sharded = ranks[0]["weights"]
    for name, want in model.named_parameters():
        torch.testing.assert_close(sharded[name], want, rtol=0, atol=0, msg=name)
