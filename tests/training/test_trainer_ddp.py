"""torchrun with 2 CPU processes (gloo) trains the same weights as one process accumulating 2 batches."""

import json
import os
import subprocess
import sys

import pytest
import torch

from specdecode.training.run import run_training
from specdecode.training.trainer import TrainConfig


@pytest.fixture(scope="module")
def data(make_regen):
    return make_regen("ddp", 24, "count the cats and dogs number {}")


def test_torchrun_ddp_matches_single_process_accumulation(tiny_llama_dir, data, tmp_path):
    target, regen = data
    ddp_out, one_out = tmp_path / "ddp", tmp_path / "one"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        "29517",
        "-m",
        "specdecode.cli",
        "train",
        "eagle",
        "--target",
        str(tiny_llama_dir),
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        "--data",
        str(regen),
        "--out",
        str(ddp_out),
        "--steps",
        "6",
        "--lr",
        "1e-3",
        "--warmup-steps",
        "2",
        "--tokens-per-batch",
        "256",
        "--eval-prompts",
        "0",
        "--draft-vocab",
        "64",
        "--ttt-steps",
        "2",
        "--checkpoint-every",
        "3",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = TrainConfig(
        out_dir=str(one_out),
        steps=6,
        lr=1e-3,
        warmup_steps=2,
        tokens_per_batch=256,
        eval_prompts=0,
        grad_accum=2,
        checkpoint_every=3,
    )
    run_training(
        "eagle", target, regen, one_out, cfg, {"draft_vocab_size": 64, "ttt_steps": 2}, progress=False
    )
    a = torch.load(ddp_out / "trainer.pt", weights_only=False)
    b = torch.load(one_out / "trainer.pt", weights_only=False)
    assert a["step"] == b["step"] == 6
    assert json.loads((ddp_out / "config.json").read_text())["training"]["world_size"] == 2
    for k in a["module"]:
        torch.testing.assert_close(a["module"][k], b["module"][k], atol=1e-5, rtol=1e-4)
