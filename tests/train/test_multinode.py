"""A run across two nodes, as users launch one: here two "nodes" on loopback with gloo, one
process each, told their place by Lightning's environment variables (MASTER_ADDR,
MASTER_PORT, NODE_RANK, WORLD_SIZE; what SLURM or a cluster's launcher sets), by torchrun
--nnodes 2 started on each, or by SLURM's variables (faked: no cluster here)."""

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import HANG_SECONDS, REPO, tiny_args

sys.path.insert(0, str(REPO / "bench"))
import fsdp_parity  # noqa: E402  (bench/, as tests/test_gpu_proof.py reads gpu_proof)

NODE = textwrap.dedent("""
    import os, signal, sys, torch
    from lightning.pytorch import Callback
    from gptmini.train.command import main

    class SignalOnThisNode(Callback):  # SIGTERM to one node only, mid-run
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    if os.environ.get("SIGNAL_NODE") == os.environ["NODE_RANK"]:
        import gptmini.train.command as training
        build = training.build_cli

        def build_cli(args=None):
            cli = build(args)
            cli.trainer.callbacks.insert(0, SignalOnThisNode())
            return cli
        training.build_cli = build_cli
    sys.exit(main(sys.argv[1:], own_signals=True))  # as train.py
""")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_train_stop_together_on_sigterm_to_one_and_resume_exactly(tmp_path):
    corpus = tmp_path / "numbers.txt"
    corpus.write_text(" ".join(str(i) for i in range(3000)))
    script = tmp_path / "node.py"
    script.write_text(NODE)
    base = tiny_args(tmp_path, corpus, "--trainer.max_steps", "6", "--trainer.num_nodes", "2",
                     "--trainer.devices", "1", "--trainer.strategy", "ddp",
                     "--model.drop_rate", "0.1", "--checkpoint_every", "100",
                     "--data.windows.stride", "4")

    def launch(*extra, signal_node: str = "") -> list[subprocess.CompletedProcess]:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "SIGNAL_NODE": signal_node,
               "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        nodes = [subprocess.Popen([sys.executable, str(script), *base, *extra], cwd=tmp_path,
                                  env={**env, "NODE_RANK": str(rank)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
        try:
            return [(node.wait(timeout=HANG_SECONDS), node.communicate()[1]) for node in nodes]
        finally:
            for node in nodes:
                node.kill()

    def weights(name: str) -> dict:
        last = tmp_path / "runs" / name / "checkpoints" / "last.ckpt"
        saved = torch.load(last, weights_only=True)
        return {"step": saved["global_step"], **saved["state_dict"]}

    straight = launch("--run_name", "straight")
    assert [code for code, _ in straight] == [0, 0], straight[0][1][-3000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in straight[1][1]
    stopped = launch("--run_name", "resumed", signal_node="1")
    assert [code for code, _ in stopped] == [143, 143], stopped[1][1][-3000:]
    steps = {err.split(" at step ")[1].split(";")[0] for _, err in stopped}
    assert len(steps) == 1 and int(steps.pop()) in (3, 4)  # both nodes, the same step
    resumed = launch("--run_name", "resumed", "--ckpt_path", "last")
    assert [code for code, _ in resumed] == [0, 0], resumed[0][1][-3000:]
    a, b = weights("straight"), weights("resumed")
    assert a["step"] == b["step"] == 6
    for key, value in a.items():
        if key != "step":
            torch.testing.assert_close(b[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.slow
def test_a_torchrun_job_of_two_nodes_trains_and_resumes_as_one_node_of_two(tmp_path):
    """FSDP2 with AdamW: torchrun --nnodes 2 started twice on 127.0.0.1, stopped at step 2
    and resumed to 4, gives the weights of torchrun with one node of two processes, bit for
    bit; so does the job started as SLURM's srun starts its tasks; and one node of two
    equals one process at the same global batch (the loss of each step within 1e-5)."""
    got = fsdp_parity.nodes(tmp_path, "adamw", steps=4, at=2, shape=fsdp_parity.TINY)
    assert got["steps"] == 4 and got["bit_for_bit"] and got["losses_equal"]
    assert got["environments"] == {"slurm": ["SLURMEnvironment"] * 2,
                                   "torchrun": ["TorchElasticEnvironment"] * 2}
    assert got["slurm_losses_equal"]
    assert got["one_process_loss_difference"] <= 1e-5
