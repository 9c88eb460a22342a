"""tools/check_env.py: the report of what this machine gives megafp8 (precision `auto`, the FP8 backends and why
each does not run), on this CPU and with the backends' answers stood in for a GPU machine's."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import torch

from megafp8.precision.backends import REGISTERED
from megafp8.precision.backends.deepgemm_backend import DeepGemmBackend
from megafp8.precision.backends.triton_backend import TritonBackend
from tests.conftest import REPO, side_by_side


def load_tool():
    spec = importlib.util.spec_from_file_location("check_env", REPO / "tools" / "check_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_on_this_cpu_it_says_the_reference_runs_and_why_each_gpu_backend_does_not():
    done, as_json = side_by_side(*(lambda args=args: subprocess.run([sys.executable, "tools/check_env.py", *args],
                                                                    cwd=REPO, capture_output=True, text=True,
                                                                    timeout=120) for args in ([], ["--json"])))
    assert done.returncode == 0, done.stderr
    assert "\n  reference  runs\n" in done.stdout
    assert "\n  hopper     no: the hopper backend needs a CUDA GPU, but this run is on cpu\n" in done.stdout
    assert "precision.fp8_backend auto -> reference\n" in done.stdout
    assert "model.attention_backend auto -> torch's own order" in done.stdout
    facts = json.loads(as_json.stdout)
    assert facts["torch"] == torch.__version__ and facts["devices"] == [] and facts["checked_on"] == "cpu"
    assert set(facts["fp8_backends"]) == {cls.name for cls in REGISTERED}
    assert facts["packages"]["numpy"] is not None


def test_where_deepgemm_fails_its_check_it_says_auto_runs_hopper_and_why(monkeypatch):
    tool = load_tool()
    monkeypatch.setattr(TritonBackend, "__init__", lambda self: None)  # its kernels need Triton
    for cls in REGISTERED:
        monkeypatch.setattr(cls, "unavailable_reason", classmethod(lambda cls, device: None))
    from megafp8.model.sdpa import _HOPPER_ORDER
    monkeypatch.setattr(tool, "sdpa_backends_for", lambda choice, device: _HOPPER_ORDER)  # as on an H200
    crashed = "DeepGEMM crashed a test process (SIGSEGV) on its first GEMM"
    monkeypatch.setattr(DeepGemmBackend, "unavailable_reason", classmethod(lambda cls, device: crashed))
    facts = tool.report(torch.device("cpu"))
    assert facts["fp8_backends"]["hopper"] is None and facts["fp8_backends"]["deepgemm"] == crashed
    assert facts["fp8_backend_auto"] == {"backend": "hopper", "passed_over": {"deepgemm": crashed}}
    text = tool.render(facts)
    assert f"  deepgemm   no: {crashed}\n" in text
    assert f"precision.fp8_backend auto -> hopper\n  (not deepgemm: {crashed})\n" in text
    assert "model.attention_backend auto -> cudnn_attention, then flash_attention, then efficient_attention, then " \
           "math (cuDNN" in text
