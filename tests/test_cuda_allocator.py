"""`training.cuda_alloc_conf`: the CUDA caching allocator's settings reach torch before CUDA starts, the environment's
own setting wins, and a malformed value is one clear config error. CPU-only: CUDA's calls are stand-ins that record
what torch would have read when it started."""
from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from megafp8.config import ConfigError, load_config
from megafp8.train import runtime
from megafp8.train.runtime import EXPANDABLE_SEGMENTS, configure_cuda_allocator, cuda_alloc_conf, pick_device
from tests.conftest import REPO, torchrun_env


@pytest.fixture
def clean_env(monkeypatch):
    """No allocator variable, and each restored afterwards (set first, so that monkeypatch records it: what the
    code under test writes must not reach later tests or the processes they start)."""
    for var in (*runtime.ALLOC_CONF_VARS, runtime.SET_BY_MEGAFP8):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    return monkeypatch


def test_the_default_turns_on_expandable_segments_before_cuda_starts(clean_env):
    """pick_device sets the variable before its first CUDA call (`set_device` starts CUDA and the allocator reads its
    settings then; job CJ showed a variable set after `import torch` but before that call takes effect on torch
    2.11)."""
    seen_at_set_device = []
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    clean_env.setattr(torch.cuda, "device_count", lambda: 1)
    clean_env.setattr(torch.cuda, "set_device",
                      lambda index: seen_at_set_device.append(runtime.os.environ.get("PYTORCH_CUDA_ALLOC_CONF")))
    cfg = load_config("tiny_dense", ["training.device=cuda"])
    assert cfg.training.cuda_alloc_conf == "auto"
    assert pick_device(cfg, 0) == torch.device("cuda", 0)
    assert seen_at_set_device == ["expandable_segments:True"]


GRAPHS = ["training.compile=true", "training.compile_mode=reduce-overhead"]


@pytest.mark.parametrize("config, overrides, expected", [
    ("tiny_dense", [], EXPANDABLE_SEGMENTS),
    ("tiny_dense", GRAPHS, EXPANDABLE_SEGMENTS),  # one rank, or data-parallel: no collective inside the graphs
    ("tiny_dense", GRAPHS + ["parallel.pp=2"], EXPANDABLE_SEGMENTS),
    ("tiny_dense", ["parallel.tp=2", "training.compile=true"], EXPANDABLE_SEGMENTS),  # compiled, no graphs
    ("tiny_dense", GRAPHS + ["parallel.tp=2"], ""),  # TP's collectives are captured: torch's allocator
    ("tiny_moe_fp8", GRAPHS + ["parallel.ep=2"], ""),
    ("tiny_dense", GRAPHS + ["parallel.cp=2"], ""),  # the keys' and values' all-gather inside the graphs
    ("tiny_dense", ["training.compile=true", "training.compile_mode=max-autotune", "parallel.tp=2"], ""),  # graphs too
    ("tiny_dense", ["training.compile=true", "training.compile_mode=max-autotune-no-cudagraphs", "parallel.tp=2"],
     EXPANDABLE_SEGMENTS),
    ("tiny_dense", GRAPHS + ["parallel.tp=2", "training.cuda_alloc_conf=expandable_segments:True"],
     EXPANDABLE_SEGMENTS),  # asked for explicitly: given
    ("tiny_dense", ["training.cuda_alloc_conf="], ""),
])
def test_auto_leaves_out_expandable_segments_where_graphs_capture_collectives(config, overrides, expected):
    assert cuda_alloc_conf(load_config(config, overrides)) == expected


def test_pick_device_applies_what_auto_resolves_to(clean_env, caplog):
    seen_at_set_device = []
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    clean_env.setattr(torch.cuda, "device_count", lambda: 2)
    clean_env.setattr(torch.cuda, "set_device",
                      lambda index: seen_at_set_device.append(runtime.os.environ.get("PYTORCH_CUDA_ALLOC_CONF")))
    with caplog.at_level(logging.INFO, logger="megafp8"):
        pick_device(load_config("tiny_dense", ["training.device=cuda", "parallel.tp=2", *GRAPHS]), 1)
    assert seen_at_set_device == [None]
    assert "CUDA graphs capture this layout's collectives" in caplog.text


def test_cpu_runs_leave_the_environment_alone(clean_env):
    assert pick_device(load_config("tiny_dense", ["training.device=cpu"]), 0).type == "cpu"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in runtime.os.environ


@pytest.mark.parametrize("var, value", [("PYTORCH_CUDA_ALLOC_CONF", ""),
                                        ("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6"),
                                        ("PYTORCH_ALLOC_CONF", "expandable_segments:False")])
def test_the_environment_wins_even_when_empty(clean_env, caplog, var, value):
    clean_env.setenv(var, value)
    with caplog.at_level(logging.INFO, logger="megafp8"):
        assert configure_cuda_allocator("expandable_segments:True") is None
    assert runtime.os.environ[var] == value
    assert "PYTORCH_CUDA_ALLOC_CONF" not in runtime.os.environ or var == "PYTORCH_CUDA_ALLOC_CONF"
    assert f"{var}={value!r} from the environment" in caplog.text


def test_the_same_setting_twice_is_quiet(clean_env, caplog):
    """benchmarks/train_step.py starts the trainer once per recipe in one process: the second start, with CUDA
    running, finds the variable the first one set, as its own, and says nothing; other settings then are a
    warning."""
    assert configure_cuda_allocator("expandable_segments:True") == "expandable_segments:True"
    clean_env.setattr(torch.cuda, "is_initialized", lambda: True)
    with caplog.at_level(logging.INFO, logger="megafp8"):
        assert configure_cuda_allocator("expandable_segments:True") is None
    assert caplog.text == ""
    with caplog.at_level(logging.INFO, logger="megafp8"):
        assert configure_cuda_allocator("") is None
    assert "cannot apply" in caplog.text


def test_a_value_megafp8_set_is_not_the_users(clean_env):
    """A megafp8 process launched from one that set the variable (it inherits it, marked) applies its own resolution:
    under TP with CUDA graphs, torch's own allocator."""
    clean_env.setenv("PYTORCH_CUDA_ALLOC_CONF", EXPANDABLE_SEGMENTS)
    clean_env.setenv(runtime.SET_BY_MEGAFP8, EXPANDABLE_SEGMENTS)
    assert runtime.users_alloc_conf() is None
    assert configure_cuda_allocator(cuda_alloc_conf(load_config("tiny_dense", [*GRAPHS, "parallel.tp=2"]))) is None
    assert "PYTORCH_CUDA_ALLOC_CONF" not in runtime.os.environ and runtime.SET_BY_MEGAFP8 not in runtime.os.environ
    clean_env.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6")  # changed since: the user's
    assert runtime.users_alloc_conf() == ("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6")


@pytest.mark.parametrize("env, overrides", [({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, []),
                                            ({}, ["training.cuda_alloc_conf=expandable_segments:True"])])
def test_expandable_segments_where_graphs_capture_collectives_is_a_warning(clean_env, caplog, env, overrides):
    for var, value in env.items():
        clean_env.setenv(var, value)
    cfg = load_config("tiny_dense", [*GRAPHS, "parallel.tp=2", *overrides])
    with caplog.at_level(logging.WARNING, logger="megafp8"):
        runtime.warn_if_graphs_meet_expandable_segments(cfg, cuda_alloc_conf(cfg))
    assert "can hang" in caplog.text


def test_empty_leaves_the_allocator_as_torch_comes(clean_env):
    assert configure_cuda_allocator("") is None
    assert "PYTORCH_CUDA_ALLOC_CONF" not in runtime.os.environ


def test_too_late_is_a_warning_not_a_silent_no_op(clean_env, caplog):
    clean_env.setattr(torch.cuda, "is_initialized", lambda: True)
    with caplog.at_level(logging.WARNING, logger="megafp8"):
        assert configure_cuda_allocator("expandable_segments:True") is None
    assert "PYTORCH_CUDA_ALLOC_CONF" not in runtime.os.environ
    assert "cannot apply" in caplog.text


@pytest.mark.parametrize("value", ["expandable_segments", "expandable_segments=True", ":True",
                                   "expandable_segments:True,garbage_collection_threshold"])
def test_a_malformed_value_is_one_config_error(value):
    with pytest.raises(ConfigError, match=r"training.cuda_alloc_conf=.*is not `key:value`"):
        load_config("tiny_dense", [f"training.cuda_alloc_conf={value}"])


def test_expandable_segments_is_spelled_as_torch_reads_it():
    with pytest.raises(ConfigError, match="expandable_segments takes True or False"):
        load_config("tiny_dense", ["training.cuda_alloc_conf=expandable_segments:true"])


@pytest.mark.parametrize("value", ["", "auto", "expandable_segments:True,garbage_collection_threshold:0.6",
                                   "backend:cudaMallocAsync", "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
                                   "expandable_segments:False,roundup_power2_divisions:[256:1,>:4]"])
def test_well_formed_values_load(value):
    assert load_config("tiny_dense", [f"training.cuda_alloc_conf={value}"]).training.cuda_alloc_conf == value


def test_a_bracketed_list_is_one_item():
    from megafp8.config.validate import _alloc_conf_items
    assert _alloc_conf_items("expandable_segments:True, roundup_power2_divisions:[256:1,512:2,>:8],") == [
        "expandable_segments:True", "roundup_power2_divisions:[256:1,512:2,>:8]"]


# Run in a fresh interpreter: the allocator reads its settings once, when CUDA starts in the process.
_SEGMENTS_AFTER_PICK_DEVICE = """
import sys, torch
from megafp8.config import load_config
from megafp8.train.runtime import pick_device
pick_device(load_config("tiny_dense", ["training.device=cuda", *sys.argv[1:]]), 0)
torch.empty(1 << 24, device="cuda")
print(sorted({segment["is_expandable"] for segment in torch.cuda.memory_snapshot()}))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("overrides, expandable", [([], "[True]"), ([*GRAPHS, "parallel.tp=2"], "[False]")])
def test_pick_device_gives_the_gpu_the_resolved_allocator(overrides, expandable):
    """On a real GPU: what `auto` resolves to is what torch's allocator does (its segments in memory_snapshot())."""
    env = {k: v for k, v in torchrun_env().items() if k not in (*runtime.ALLOC_CONF_VARS, runtime.SET_BY_MEGAFP8)}
    result = subprocess.run([sys.executable, "-c", _SEGMENTS_AFTER_PICK_DEVICE, *overrides], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == expandable, result.stdout + result.stderr
