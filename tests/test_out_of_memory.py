"""Running out of device memory ends the run with one line that says where, the plan's figure and what to change,
instead of torch's paragraph and a traceback per rank."""
from __future__ import annotations

import pytest
import torch

from megafp8.train import main

TORCH_MESSAGE = ("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 139.81 GiB of which "
                 "1.02 GiB is free. Of the allocated memory 130.11 GiB is allocated by PyTorch. If reserved but "
                 "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")


def _run(overrides: list[str]) -> int:
    return main.run(main.parse_args(["--config", "tiny_dense", *overrides]))


def test_out_of_memory_in_a_step_is_one_line_with_what_to_change(tiny_overrides, monkeypatch, capsys):
    def fit(trainer):
        trainer.state.step = 6  # six steps done: the seventh ran out
        raise torch.OutOfMemoryError(TORCH_MESSAGE)

    monkeypatch.setattr(main.Trainer, "fit", fit)
    assert _run(tiny_overrides) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert line.startswith("error: out of memory at step 7 (allocating 2.50 GiB); planned ")
    assert "GiB per rank. To fit: lower training.micro_batch_size (now 2;" in line
    assert "or set training.recompute=full" in line and "parallel.tp, parallel.pp, parallel.ep" in line
    assert "tools/plan.py --config ... --world-size 1" in line


def test_out_of_memory_while_setting_up_says_so_and_leaves_out_what_is_already_set(tiny_overrides, monkeypatch,
                                                                                      capsys):
    def build(*args, **kwargs):
        raise torch.OutOfMemoryError("DefaultCPUAllocator: not enough memory: you tried to allocate 4096 bytes.")

    monkeypatch.setattr(main, "Trainer", build)
    assert _run([*tiny_overrides, "training.recompute=full", "training.micro_batch_size=1"]) == 1
    line = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("error:"))
    assert line.startswith("error: out of memory while setting up; planned ")
    assert "To fit: spread the model over more GPUs" in line and "recompute" not in line
    assert "micro_batch_size" not in line
    assert _run([*tiny_overrides, "training.recompute=full", "training.recompute_layers=1",
                 "training.micro_batch_size=1"]) == 1
    line = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("error:"))
    assert "To fit: raise training.recompute_layers (now 1; null recomputes every block), or spread" in line


@pytest.mark.parametrize("error", [FloatingPointError("loss is nan"), torch.OutOfMemoryError("x")])
def test_the_run_directory_stays_usable(tiny_overrides, monkeypatch, error):
    """After the error the process group is shut down and the next run in the same process starts (as the CLI
    would after a relaunch with a smaller micro-batch)."""
    monkeypatch.setattr(main.Trainer, "fit", lambda trainer: (_ for _ in ()).throw(error))
    assert _run(tiny_overrides) == 1
    monkeypatch.undo()
    assert _run([*tiny_overrides, "training.steps=2", "training.eval_interval=0"]) == 0
