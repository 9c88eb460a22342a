"""SLURM for real: a one-node cluster (launch/slurm/local_cluster.sh), then `sbatch --wait` of the tiny config
through launch/slurm/pretrain.sbatch (2 CPU ranks). Skips where SLURM is not installed or cannot start (not
root, no munge) and where a SLURM controller already runs (it is not ours to use or stop); fails if the cluster
is up and the job does not train and exit 0. The daemons it starts are stopped at the end.

With MEGAFP8_REQUIRE_SLURM=1 (set by `.ci/run` once it has installed SLURM) every skip becomes a failure, so a
passing CI run with SLURM installed is one where the job really trained."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest

from tests.conftest import REPO, TINY_OVERRIDES, torchrun_env

REQUIRED = os.environ.get("MEGAFP8_REQUIRE_SLURM") == "1"


def _skip(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"MEGAFP8_REQUIRE_SLURM=1 but the SLURM test cannot run: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def one_node_cluster(tmp_path_factory):
    """SLURM_CONF of a one-node cluster started for this module's tests (its slurmctld and slurmd stopped
    afterwards). One for them all: a daemon signalled to stop is still there for a while, and the next test's own
    cluster would then find a slurmctld running and skip."""
    if shutil.which("slurmctld") is None or shutil.which("sbatch") is None or os.geteuid() != 0:
        _skip("needs root and Debian's slurmctld, slurmd, slurm-client and munge")
    if subprocess.run(["pgrep", "-x", "slurmctld"], capture_output=True).returncode == 0:
        _skip("a slurmctld already runs on this machine: the test only starts its own cluster where none runs")
    state = tmp_path_factory.mktemp("slurm")
    # MIN_JOB_AGE=10: `sbatch --wait` asks after its job every 8 s (at 2, 10, 18, 26 s, ...), not at 2, 10, 42, 74 s,
    # ...: at SLURM's default a job of 11-40 s, as on a loaded CI machine (45 s there), returned after 42 s
    started = subprocess.run(["bash", str(REPO / "launch/slurm/local_cluster.sh"), str(state)], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "MIN_JOB_AGE": "10"})
    try:
        if started.returncode != 0 or "idle" not in started.stdout:
            _skip(f"a one-node SLURM cluster could not start here: {(started.stderr or started.stdout)[-500:]}")
        yield state / "slurm.conf"
    finally:
        for daemon in ("slurmd", "slurmctld"):
            pid_file = state / f"{daemon}.pid"
            if pid_file.exists():
                subprocess.run(["kill", pid_file.read_text().strip()], capture_output=True)


def test_sbatch_trains_the_tiny_config(corpus_dir, tmp_path, one_node_cluster):
    """Submitted through launch/slurm/submit.py, which sizes the job from the layout (here 1 node x 2 CPU ranks). A
    CUDA_VISIBLE_DEVICES left in the submitting shell reached the CPU job (sbatch passes the environment on), whose
    ranks then took it for GPUs given to the job (training.device=auto refuses their CPU): --cpu hides the GPUs."""
    env = {**torchrun_env(), "SLURM_CONF": str(one_node_cluster), "CUDA_VISIBLE_DEVICES": "0"}
    overrides = TINY_OVERRIDES + [f"data.path={corpus_dir}", f"logging.output_dir={tmp_path / 'runs'}",
                                  "run_name=slurm", "training.steps=4", "training.eval_interval=0"]
    job = subprocess.run(
        [sys.executable, str(REPO / "launch/slurm/submit.py"), "--config", "tiny_dense", "--cpu",
         "--procs-per-node", "2", "--sbatch=--wait", f"--sbatch=--output={tmp_path}/job.out", *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert job.returncode == 0, f"{job.stdout}{job.stderr}\n{out[-3000:]}"
    assert "on 1 node(s) x 2 process(es)" in out and "step 4/4" in out, out[-3000:]
    assert (tmp_path / "runs" / "slurm" / "metrics.jsonl").exists()


def test_srun_tasks_without_torchrun_stop_and_the_other_starts_run(corpus_dir, tmp_path, one_node_cluster):
    """`srun -n 2 python launch/pretrain.py` (no torchrun): each task took itself for rank 0 of 1 and trained alone.
    They now stop at once, the line printed once. The starts that do run pass the same check, under SLURM's own
    variables: the batch script of a 2-task job running it once, `srun -n 1`, a torchrun in each task of a 2-task
    step (launch/slurm/pretrain.sbatch's on two nodes), whose workers inherit SLURM_STEP_NUM_TASKS=2, and one python
    in an interactive shell of `srun -n 2 --pty`, which inherits it too. Dry runs: the check comes before planning
    or training alike."""
    with socket.socket() as s:  # a free port for the two torchruns' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = f"launch/pretrain.py --config tiny_dense --dry-run data.path={corpus_dir}"
    torchrun = (f"{sys.executable} -m torch.distributed.run --nnodes=2 --nproc_per_node=1 --rdzv_backend=c10d "
                f"--rdzv_endpoint=127.0.0.1:{port} --rdzv_id=$SLURM_JOB_ID")
    # `srun --pty` needs a terminal: `script` gives it one. Task 0's shell runs one python, as a person there would.
    shell = f"script -qec \"srun -n 2 --pty bash -c '[ \\$SLURM_PROCID = 1 ] || {sys.executable} {args}'\" /dev/null"
    starts = {"srun -n 2 python": (f"srun -n 2 {sys.executable} {args}", 2),  # (the error line to job.out)
              "batch script": (f"{sys.executable} {args} > /dev/null", 0),
              "srun -n 1 python": (f"srun -n 1 {sys.executable} {args} > /dev/null", 0),
              "srun -n 2 torchrun": (f"srun -n 2 {torchrun} {args} > /dev/null", 0),
              "a shell of srun -n 2 --pty": (f"{shell} > /dev/null", 0)}
    (tmp_path / "job.sh").write_text(f"#!/bin/bash\ncd {REPO}\n" + "".join(
        f'{command}; echo "{name}: exit $?"\n' for name, (command, _) in starts.items()))
    job = subprocess.run(["sbatch", "--wait", "--ntasks=2", f"--output={tmp_path}/job.out", str(tmp_path / "job.sh")],
                         env={**torchrun_env(), "SLURM_CONF": str(one_node_cluster)}, capture_output=True, text=True,
                         timeout=600)
    out = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert job.returncode == 0, f"{job.stdout}{job.stderr}\n{out[-3000:]}"
    assert out.count("error: srun started this process as one of 2 tasks (SLURM_STEP_NUM_TASKS=2) without "
                     "torchrun") == 1, out[-3000:]
    for name, (_, status) in starts.items():
        assert f"{name}: exit {status}\n" in out, out[-3000:]
