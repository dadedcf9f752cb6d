"""bench/parallel_check.py (the NCCL correctness check of issue 15) on two gloo ranks: in fp32 the
expert-parallel engine gives the one process's logprobs, gradients and seeded samples."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_parallel_check_runs_and_agrees_on_the_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, str(ROOT / "bench" / "parallel_check.py"), "--shape", "tiny-moe", "--nproc", "2",
                    "--ep", "2", "--seq-len", "24", "--out", str(tmp_path)], check=True, env=env, timeout=600,
                   capture_output=True)
    report = json.loads((tmp_path / "parallel_check_tiny-moe_ep2_tp1.json").read_text())
    assert report["logprobs"]["parallel"]["max"] < 1e-5
    worst, total = report["grads"]["parallel"]
    assert worst < 1e-5 and total < 1e-5
    assert report["samples"]["parallel"]["identical"] == "8/8"
    norms = report["grad_norm"]
    assert abs(norms["parallel"] - norms["exact"]) < 1e-5 * norms["exact"]
    assert abs(norms["one process"] - norms["exact"]) < 1e-6 * norms["exact"]  # summed in float64 on the CPU
