"""SLURM job shapes from configs (launch/slurm/submit.py), without a cluster: `--print-only`."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from megafp8.config import ConfigError, load_config
from megafp8.train.submit import check_sbatch_args, job_shape, sbatch_command
from tests.conftest import REPO, side_by_side, torchrun_env


def test_the_layout_sets_the_nodes():
    shape = job_shape(load_config("671b_fp8"), 8)  # tp 1 x pp 16 x ep 64 ranks at least
    assert (shape.nodes, shape.procs_per_node, shape.world_size) == (128, 8, 1024)
    assert job_shape(load_config("671b_fp8"), 8, nodes=256).world_size == 2048  # the paper's 2048 GPUs
    assert job_shape(load_config("tiny_dense", ["parallel.dp=2"]), 8).world_size == 2  # fewer than one node
    assert job_shape(load_config("tiny_dense", ["parallel.tp=2", "model.num_heads=4", "model.attention.num_kv_heads=2",
                                                "model.attention.head_dim=128"]), 8).world_size == 8  # fills the node
    command = sbatch_command("671b_fp8.yaml", ["optimizer.lr=1e-4"], job_shape(load_config("671b_fp8"), 8), True,
                             ["--time=1:00:00"])
    assert command == ["sbatch", "--nodes=128", "--gpus-per-node=8", "--export=ALL,GPUS_PER_NODE=8", "--time=1:00:00",
                       "launch/slurm/pretrain.sbatch", "--config", "671b_fp8.yaml", "optimizer.lr=1e-4"]


def test_a_context_parallel_layout_gets_the_fewest_nodes_it_needs():
    """Context-parallel groups are made of data-parallel ranks, so dp must be a multiple of cp as of ep. The shape
    counted tp x pp x ep alone: parallel.cp=16 got one 8-rank node and was refused ("launch a multiple of 16
    ranks") where two nodes run it."""
    shape = job_shape(load_config("tiny_dense", ["parallel.cp=16"]), 8)
    assert (shape.nodes, shape.procs_per_node) == (2, 8)
    assert job_shape(load_config("tiny_dense", ["parallel.cp=2"]), 8).world_size == 8  # cp within one node


@pytest.mark.parametrize("overrides, nodes, message", [
    (["parallel.dp=12"], None, "the layout needs 12 ranks .* do not fill whole nodes of 8"),
    (["parallel.tp=3"], None, "not divisible by parallel.tp=3"),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "model.num_layers=3"], 1,
     "model.num_layers=3 cannot fill 4 pipeline stages"),
])
def test_layouts_that_cannot_run_are_refused_before_submitting(overrides, nodes, message):
    with pytest.raises(ConfigError, match=message):
        job_shape(load_config("tiny_dense", overrides), 8, nodes)


def test_the_tool_checks_memory_and_prints_the_command():
    def tool(*args):
        return subprocess.run([sys.executable, "launch/slurm/submit.py", "--print-only", *args], cwd=REPO,
                              env=torchrun_env(), capture_output=True, text=True, timeout=120)

    ok, too_big = side_by_side(lambda: tool("--config", "671b_fp8.yaml", "--nodes", "256"),
                               lambda: tool("--config", "671b_fp8.yaml", "parallel.pp=1", "parallel.pp_layout=null"))
    assert ok.returncode == 0, ok.stderr
    assert "256 node(s) x 8 process(es) = 2048 ranks" in ok.stdout and "sbatch --nodes=256 --gpus-per-node=8" in ok.stdout
    # too_big (parallel.pp=1, no layout): ~209 GiB per GPU
    assert too_big.returncode == 2 and "GiB per GPU" in too_big.stderr and "139.0 GiB" in too_big.stderr


def test_a_missing_sbatch_is_one_line(tmp_path):
    """0800a78 raised a FileNotFoundError traceback where sbatch is not installed."""
    env = {**torchrun_env(), "PATH": str(tmp_path)}  # no sbatch (nor anything else) on PATH
    result = subprocess.run([sys.executable, "launch/slurm/submit.py", "--config", "tiny_dense", "--cpu",
                             "--procs-per-node", "2"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == ("error: sbatch is not on PATH: run this on a SLURM login node, or pass --print-only to "
                             "see the command\n")


SBATCH = ["bash", str(REPO / "launch/slurm/pretrain.sbatch"), "--config", "tiny_dense"]


def _stand_ins(tmp_path, srun: str = "") -> dict[str, str]:
    """Stand-ins for `scontrol`, `torchrun` and `srun` (by default one that prints what torchrun would get) in
    tmp_path/bin; returns the job's environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node1\n")
    (bin_dir / "torchrun").write_text("#!/bin/sh\nexit 0\n")  # on PATH, as a virtualenv would put it
    (bin_dir / "srun").write_text(srun or '#!/bin/sh\necho "PYTHONPATH=$PYTHONPATH"\necho "LD_PRELOAD=$LD_PRELOAD"\n'
                                          'echo "SIGNALS=$TORCHELASTIC_SIGNALS_TO_HANDLE"\n'
                                          'echo "EXPECTS_GPUS=$MEGAFP8_EXPECTS_GPUS"\necho "ARGS=$*"\n')
    for name in ("scontrol", "srun", "torchrun"):
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_ID": "7",
            "SLURM_JOB_NUM_NODES": "1", "SLURM_SUBMIT_DIR": str(REPO), "MEGAFP8_VENV": str(tmp_path / "no_venv")}


def _sbatch_script(tmp_path, **env):
    """launch/slurm/pretrain.sbatch run with the stand-ins (`_stand_ins`)."""
    return subprocess.run(SBATCH, env={**_stand_ins(tmp_path), **env}, capture_output=True, text=True, timeout=60)


def test_the_sbatch_script_without_torchrun_stops_before_srun(tmp_path):
    """No virtualenv and no torchrun on PATH: one line before srun, not execve's "No such file" from every node's
    task after the allocation."""
    env = _stand_ins(tmp_path)
    (tmp_path / "bin" / "torchrun").unlink()
    done = subprocess.run(SBATCH, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "ARGS=" not in done.stdout
    assert done.stderr.count("\n") == 1 and "torchrun is not on PATH" in done.stderr, done.stderr


@pytest.mark.parametrize("signal_name", ["USR1", "TERM"])
def test_a_signal_to_the_batch_shell_reaches_srun(tmp_path, signal_name):
    """`sbatch --signal=B:USR1@<s>` signals the batch shell alone, which died of it (and SLURM then ended the step
    before the ranks' checkpoint); the script hands it to srun, which passes it on to the ranks, waits for srun to
    end and exits with its status."""
    ready = tmp_path / "srun_started"
    env = _stand_ins(tmp_path, f"#!/bin/bash\ntrap 'echo srun got USR1; exit 3' USR1\n"
                               f"trap 'echo srun got TERM; exit 4' TERM\ntouch {ready}\n"
                               "for i in $(seq 300); do sleep 0.1; done\necho srun was not signalled\n")
    shell = subprocess.Popen(SBATCH, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    shell.send_signal(getattr(signal, f"SIG{signal_name}"))
    out, err = shell.communicate(timeout=30)
    assert f"srun got {signal_name}" in out, (out, err)
    assert shell.returncode == (3 if signal_name == "USR1" else 4)


def test_the_sbatch_script_sources_megafp8_env_file_for_every_node(tmp_path):
    """MEGAFP8_ENV_FILE (e.g. tools/install_deepgemm.py's deepgemm.env) is sourced before srun, which passes what it
    exports to torchrun; a path that does not exist stops the job with one line, before srun runs."""
    env_file = tmp_path / "deepgemm.env"
    env_file.write_text('export PYTHONPATH="/dg/plain${PYTHONPATH:+:$PYTHONPATH}"\nexport LD_PRELOAD="/gcc/libstdc++.so.6"\n')
    done = _sbatch_script(tmp_path, MEGAFP8_ENV_FILE=str(env_file), PYTHONPATH="/mine")
    assert done.returncode == 0, done.stderr
    assert "PYTHONPATH=/dg/plain:/mine" in done.stdout and "LD_PRELOAD=/gcc/libstdc++.so.6" in done.stdout
    assert "launch/pretrain.py --config tiny_dense" in done.stdout
    plain = _sbatch_script(tmp_path)
    assert plain.returncode == 0 and "LD_PRELOAD=\n" in plain.stdout
    missing = _sbatch_script(tmp_path, MEGAFP8_ENV_FILE=str(tmp_path / "nope.env"))
    assert missing.returncode == 2 and "ARGS=" not in missing.stdout
    assert missing.stderr.count("\n") == 1 and "nope.env does not exist" in missing.stderr


def test_a_config_file_named_relative_to_the_submit_directory_is_the_one_the_job_loads(tmp_path):
    """The job runs in the repository root (submit.py calls sbatch there), so a config path relative to where
    submit.py ran reaches the job absolute. It used to pass as given: the job then failed on a missing file after
    waiting for its nodes, or, where configs/ has a file of that name, silently trained that one instead."""
    (tmp_path / "tiny_dense.yaml").write_text((REPO / "configs/tiny_dense.yaml").read_text()
                                              .replace("steps: 200", "steps: 70"))
    result = subprocess.run([sys.executable, str(REPO / "launch/slurm/submit.py"), "--print-only", "--cpu",
                             "--procs-per-node", "2", "--config", "tiny_dense.yaml"], cwd=tmp_path, env=torchrun_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"--config {tmp_path / 'tiny_dense.yaml'}" in result.stdout, result.stdout


def test_a_config_name_found_in_the_submit_directorys_configs_is_the_one_the_job_loads(tmp_path):
    """A bare name is looked for in the working directory's configs/ first: submit.py checked that file but passed
    the name as given, and the job, in the repository root, trained the repository's configs/ file of that name (or
    failed on a name it lacks, after waiting for its nodes). A symlinked config reached the job resolved, and the
    run took the target's name as its run_name."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/tiny_dense.yaml").write_text((REPO / "configs/tiny_dense.yaml").read_text()
                                                      .replace("steps: 200", "steps: 70"))
    (tmp_path / "my_run.yaml").symlink_to(tmp_path / "configs/tiny_dense.yaml")

    def submitted(config: str) -> str:
        result = subprocess.run([sys.executable, str(REPO / "launch/slurm/submit.py"), "--print-only", "--cpu",
                                 "--procs-per-node", "2", "--config", config], cwd=tmp_path, env=torchrun_env(),
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert f"--config {tmp_path / 'configs/tiny_dense.yaml'}\n" in submitted("tiny_dense")
    assert f"--config {tmp_path / 'my_run.yaml'}\n" in submitted("my_run.yaml")


def test_the_sbatch_script_submitted_outside_the_checkout_stops_before_srun(tmp_path):
    """The job runs `launch/pretrain.py` from the submit directory (SLURM runs a copy of the script, so the script
    cannot find its checkout). Submitted from elsewhere it used to start srun on every node, where each torchrun's
    workers failed with "can't open file"; it stops first, with one line that says where to submit from."""
    done = _sbatch_script(tmp_path, SLURM_SUBMIT_DIR=str(tmp_path))
    assert done.returncode == 2 and "ARGS=" not in done.stdout
    assert done.stderr.count("\n") == 1 and "submit from the repository root" in done.stderr, done.stderr


def test_a_gpu_job_launches_the_processes_per_node_it_was_checked_for(tmp_path):
    """sbatch passes the submitter's environment on, and the script takes GPUS_PER_NODE before SLURM's GPU count: a
    GPU job's command set no GPUS_PER_NODE, so one left in the submitting shell (4 here) launched 4 processes on
    each 8-GPU node, another world size than submit.py checked (half the GPUs idle, or, above the GPU count, ranks
    without a GPU). The command sets it as CPU jobs' does."""
    command = sbatch_command("tiny_dense", [], job_shape(load_config("tiny_dense", ["training.micro_batch_size=2"]), 8), True, [])
    exports = [arg.removeprefix("--export=ALL,") for arg in command if arg.startswith("--export=ALL,")]
    job_env = {**_stand_ins(tmp_path), "GPUS_PER_NODE": "4", "SLURM_GPUS_ON_NODE": "8",  # (the stale one, SLURM's)
               **dict(item.split("=", 1) for export in exports for item in export.split(","))}
    done = subprocess.run(SBATCH, env=job_env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--nproc_per_node=8 " in done.stdout, done.stdout


def test_a_job_that_asked_for_no_gpus_and_no_processes_has_its_ranks_expect_gpus(tmp_path):
    """Submitted without --gpus-per-node and without GPUS_PER_NODE, the script starts 8 processes per node for 8
    GPUs; where the job then has none (it lacks the GPU request), they trained on the CPU with a log line only. The
    script tells the ranks it assumed GPUs (training.device=auto then stops where torch finds none: test_device.py);
    a GPU job's count from SLURM or a CPU job's GPUS_PER_NODE tells them nothing, a stale value included."""
    assumed = _sbatch_script(tmp_path)
    assert "EXPECTS_GPUS=8\n" in assumed.stdout and "--nproc_per_node=8 " in assumed.stdout, assumed.stdout
    for counted in ({"SLURM_GPUS_ON_NODE": "4"}, {"GPUS_PER_NODE": "2", "MEGAFP8_EXPECTS_GPUS": "8"}):
        done = _sbatch_script(tmp_path, **counted)
        assert done.returncode == 0 and "EXPECTS_GPUS=\n" in done.stdout, done.stdout


def test_the_sbatch_script_has_torchrun_pass_sigusr1_on(tmp_path):
    """`sbatch --signal=USR1@<s>` signals every process of the step: torchrun too, which by default does not handle
    SIGUSR1 and died of it, and srun then ended the step, its workers with it, before their checkpoint. The script
    has torchrun pass SIGUSR1 on as it does SIGTERM; a TORCHELASTIC_SIGNALS_TO_HANDLE of the user's own wins."""
    done = _sbatch_script(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "SIGNALS=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1\n" in done.stdout
    own = _sbatch_script(tmp_path, TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM")
    assert "SIGNALS=SIGTERM\n" in own.stdout


def _submit_main():
    """launch/slurm/submit.py's `main`, imported from its directory."""
    sys.path.insert(0, str(REPO / "launch" / "slurm"))
    try:
        from submit import main
    finally:
        sys.path.remove(str(REPO / "launch" / "slurm"))
    return main


@pytest.mark.parametrize("value, message", [("nan", "nan must be a number above 0"),  # was ValueError's traceback
                                            ("inf", "inf must be a number above 0"),  # OverflowError's
                                            ("-5", "-5 must be a number above 0")])   # "the GPU has -5.0 GiB"
def test_a_gpu_memory_that_is_not_a_positive_size_is_refused_by_the_parser(capsys, value, message):
    main = _submit_main()
    with pytest.raises(SystemExit):
        main(["--gpu-memory-gib", value, "--config", "tiny_dense"])
    assert f"argument --gpu-memory-gib: {message}" in capsys.readouterr().err


def test_a_key_given_twice_is_warned_of_at_submission(capsys):
    """The job's launcher uses the last value and warns in the job's log; submit.py warns at once, where the user
    is looking, and submits the same command line."""
    main = _submit_main()
    assert main(["--config", "tiny_dense", "--print-only", "--cpu", "--procs-per-node", "2", "training.steps=10",
                 "training.steps=20"]) == 0
    out, err = capsys.readouterr()
    assert err == ("warning: override training.steps is given 2 times (training.steps=10, training.steps=20): "
                   "training.steps=20 is used\n"), err
    assert "training.steps=10 training.steps=20" in out


def test_an_sbatch_argument_that_sets_the_shape_again_is_refused(capsys):
    """`--sbatch=--nodes=2` came after submit.py's own `--nodes=1` in the sbatch command, and sbatch takes the last:
    the job ran on 2 nodes, another world size than the one the layout was checked for, without a word."""
    main = _submit_main()
    assert main(["--config", "tiny_dense", "--print-only", "--cpu", "--procs-per-node", "2",
                 "--sbatch=--nodes=2"]) == 2
    out, err = capsys.readouterr()
    assert "sbatch" not in out
    assert err == ("error: --sbatch=--nodes=2 would set the job's nodes, which submit.py sizes from the config's "
                   "layout, and the job would run another world size than the one checked: pass --nodes N to "
                   "submit.py (the layout is then checked for N x --gpus-per-node ranks), or set parallel.dp\n"), err


@pytest.mark.parametrize("args, names", [
    (["-N", "2"], "nodes"), (["-N2"], "nodes"), (["--nodes 2"], "nodes"),
    (["--ntasks-per-node=2"], "tasks"), (["--ntasks-per-n=2"], "tasks"),  # sbatch takes an unambiguous prefix
    (["-n", "16"], "tasks"), (["--ntasks=16"], "tasks"),
    (["--gpus-per-node=4"], "GPUs"), (["-G", "8"], "GPUs"), (["--gres=gpu:h100:8"], "GPUs"),
    (["--gres", "gpu:8"], "GPUs"),
    (["--export=ALL,FOO=1"], "environment"),  # sbatch keeps the last --export: GPUS_PER_NODE would be lost
])
def test_every_form_of_a_shape_option_is_refused(args, names):
    with pytest.raises(ConfigError, match=f"would set the job's {names}"):
        check_sbatch_args(["--wait", *args])


def test_sbatch_arguments_that_leave_the_shape_alone_pass():
    check_sbatch_args(["--time=12:00:00", "--wait", "--output=job.out", "--nodelist=node1", "--exclusive",
                       "--gres=nvme:1", "--gres", "nvme:1", "--ntasks-per-core=1", "--job-name=mine",
                       "--signal=TERM@120", "-t", "10", "--dependency=afterany:7", "--export-file=my.env"])
