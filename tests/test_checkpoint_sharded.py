"""Sharded checkpoints (torch.distributed.checkpoint): every rank writes its own pieces; any layout loads them.

Runs are FP32, so a checkpoint read back at another layout gives the same validation loss to 1e-5
(layouts differ only in summation order)."""
from __future__ import annotations

import errno
import math
import os
import pickle

import pytest
import torch

from megafp8.checkpoint import find_latest, load_checkpoint
from megafp8.checkpoint.integrity import MANIFEST_FILE, FileRecord, file_digest, write_manifest
from megafp8.config import ConfigError, load_config
from megafp8.parallel import ParallelDims
from megafp8.train.trainer import Trainer
from tests.distributed import spawn

TP_MODEL = ["model.num_heads=2", "model.attention.num_kv_heads=2", "model.attention.head_dim=128",
            "model.vocab_size=512", "model.num_layers=4", "precision.recipe=fp32", "training.eval_interval=100",
            "training.eval_iters=4"]


def _worker(rank, world, overrides, out_path):
    """Build (resuming if the checkpoint dir has one), report the step and validation loss, then train on."""
    cfg = load_config("tiny_dense", overrides)
    trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel) if world > 1 else ParallelDims.single(),
                      torch.device("cpu"))
    step, val = trainer.step, trainer.evaluate()
    records = trainer.fit()
    if rank == 0:
        torch.save({"step": step, "val": val, "losses": [r["loss"] for r in records if r["kind"] == "train"]},
                   out_path)


def _run(world, overrides, out_path):
    if world == 1:
        _worker(0, 1, overrides, out_path)
    else:
        spawn(world, _worker, overrides, out_path)
    return torch.load(out_path)


@pytest.mark.parametrize("saved_at, loaded_at", [
    ((4, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]), [(1, []), (4, [])]),
    ((1, []), [(4, ["parallel.tp=2", "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"])]),
    # A context-parallel run's loader reads each sample's share of tokens; its saved state still records the whole
    # samples' length (its first save failed on reading that length from the share).
    ((2, ["parallel.cp=2"]), [(1, [])]),
], ids=["tp2_pp2_to_one_rank_and_dp4", "one_rank_to_tp2_pp2", "cp2_to_one_rank"])
def test_a_checkpoint_loads_at_other_layouts(tiny_overrides, tmp_path, saved_at, loaded_at):
    """Saved at one layout, read at others: the same step and the same validation loss on the fixed held-out
    batches; each saving rank wrote its own file."""
    ckpt = tmp_path / "ck"
    base = tiny_overrides + TP_MODEL + [f"checkpoint.dir={ckpt}"]
    world, extra = saved_at
    _run(world, base + extra + ["training.steps=3", "checkpoint.interval=3", "checkpoint.resume=none"],
         tmp_path / "save.pt")
    latest = find_latest(ckpt)
    shard_files = sorted(p.name for p in latest.iterdir() if p.suffix == ".distcp")
    assert shard_files == [f"__{r}_0.distcp" for r in range(world)]  # one file per rank
    reference = None
    for i, (load_world, load_extra) in enumerate(loaded_at + [saved_at]):
        got = _run(load_world, base + load_extra + ["training.steps=4", "checkpoint.interval=0"], tmp_path / f"{i}.pt")
        assert got["step"] == 3
        reference = got["val"] if reference is None else reference
        assert math.isclose(got["val"], reference, rel_tol=1e-5), (load_world, load_extra, got["val"], reference)


def test_resume_at_pp2_is_bit_identical(tiny_overrides, tmp_path):
    """Stop at step 3 and resume under a zero-bubble pipeline: the next losses equal an uninterrupted run's."""
    base = tiny_overrides + TP_MODEL + ["parallel.pp=2", "parallel.pp_schedule=zbv", "training.steps=6"]
    straight = _run(2, base + ["checkpoint.resume=none"], tmp_path / "straight.pt")["losses"]
    ckpt = [f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.interval=3"]
    _run(2, base + ckpt + ["training.steps=3"], tmp_path / "first.pt")
    resumed = _run(2, base + ckpt, tmp_path / "resumed.pt")
    assert resumed["step"] == 3 and resumed["losses"] == straight[3:]


def test_async_sharded_save_on_two_ranks(tiny_overrides, tmp_path):
    """checkpoint.async_save with the sharded form: the background writes (on their own gloo group) complete,
    are published in order, and resume."""
    base = tiny_overrides + TP_MODEL + [f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.interval=3",
                                        "checkpoint.async_save=true", "checkpoint.keep_last=0"]
    _run(2, base + ["training.steps=6"], tmp_path / "r.pt")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [".lock", "latest", "step_00000003",
                                                                  "step_00000006"]
    assert load_checkpoint(find_latest(tmp_path / "ck"))["step"] == 6


# ------------------------------------------------------------------------------------- safety

def _saved(tiny_overrides, tmp_path):
    overrides = tiny_overrides + [f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.resume=none"]
    trainer = Trainer(load_config("tiny_dense", overrides), ParallelDims.single(), torch.device("cpu"))
    trainer.train_step()
    trainer.save()
    return find_latest(tmp_path / "ck"), tiny_overrides + [f"checkpoint.dir={tmp_path / 'ck'}"]


def _rank0_cannot_write_worker(rank, world, overrides, failing):
    from megafp8.train import checkpointing

    cfg = load_config("tiny_dense", overrides)
    trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel), torch.device("cpu"))

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if rank == 0:  # the rank that does a checkpoint's file work alone
        monkeypatch = pytest.MonkeyPatch()
        monkeypatch.setattr(checkpointing, failing, disk_full)
    trainer.train_step()
    with pytest.raises(checkpointing.CheckpointWriteError, match=r"checkpoint of step \d not saved: .*rank 0.*No "
                                                                  "space left on device"):
        trainer.save()
        trainer.train_step()
        trainer.save()  # a background write's error surfaces at the next save
    if "checkpoint.async_save=true" in overrides:  # and the last step's, when training ends, on every rank
        with pytest.raises(checkpointing.CheckpointWriteError, match="No space left on device"):
            trainer.fit()


@pytest.mark.parametrize("failing, settings", [
    ("fresh_temporary", []), ("publish", []), ("publish", ["checkpoint.async_save=true"]),
    ("save_checkpoint", ["checkpoint.format=full"])])
def test_a_checkpoint_rank_0_cannot_write_fails_every_rank_in_one_error(tiny_overrides, tmp_path, failing, settings):
    """Rank 0 alone creates a sharded checkpoint's directory and publishes it, and writes a full checkpoint: where it
    failed (a full disk) its peers were left waiting in the next collective (the broadcast of the directory, the
    barrier after the save), and under `checkpoint.async_save` they went on training while rank 0 stopped. Every
    rank now raises the same CheckpointWriteError."""
    spawn(2, _rank0_cannot_write_worker, tiny_overrides + settings + [
        f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.resume=none", "checkpoint.interval=100",
        "training.eval_interval=0"], failing)


def test_a_save_that_runs_out_of_memory_gathering_is_out_of_memory(tiny_overrides, tmp_path, monkeypatch):
    """Only a save's rank-local file work is agreed on as a CheckpointWriteError: an exception in its collective part
    (gathering the full model for the full form) propagates as itself, so an out-of-memory error keeps the launcher's
    advice on memory, and a rank failing there alone does not enter the agreement while its peers still gather."""
    from megafp8.train import checkpointing

    overrides = tiny_overrides + [f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.resume=none",
                                  "checkpoint.format=full"]
    trainer = Trainer(load_config("tiny_dense", overrides), ParallelDims.single(), torch.device("cpu"))
    trainer.train_step()

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(checkpointing.ModelState, "full_state", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        trainer.save()


def _write_group_timeout_worker(rank, world, directory):
    import time

    import torch.distributed as dist

    from megafp8.train.checkpointing import Checkpointer

    cfg = load_config("tiny_dense", ["checkpoint.format=sharded", "checkpoint.async_save=true",
                                     "parallel.timeout_minutes=0.02"])  # 1.2 s
    dims = ParallelDims.from_config(cfg.parallel)
    group = Checkpointer(None, None, None, {}, {}, cfg.checkpoint, directory, dims).write_group
    late = 8.0  # rank 1 joins the background writes' group 8 s late: too late at 1.2 s
    gave_up = directory.parent / "rank0_gave_up"  # (the checkpoint directory is never made here)
    if rank == 0:
        started = time.monotonic()
        with pytest.raises(RuntimeError):  # (under torch's default, 30 minutes on gloo, it waited for the peer)
            dist.all_reduce(torch.ones(1), group=group)
        assert time.monotonic() - started < late
        gave_up.touch()
    else:
        # Late: until rank 0 has given up (1.2 s when the timeout holds; the suite need not sit out all 8 s), and at
        # most 8 s (when it does not hold, rank 0 is still waiting then and the all-reduce completes).
        deadline = time.monotonic() + late
        while not gave_up.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            dist.all_reduce(torch.ones(1), group=group)
        except RuntimeError:
            pass  # its peer has given up


def test_parallel_timeout_applies_to_the_background_writes_group(tmp_path):
    """`parallel.timeout_minutes` holds on the gloo group of `checkpoint.async_save`'s background writes too: it
    took torch's 30-minute default, so a background write waiting on a dead peer outlived the run's timeout."""
    spawn(2, _write_group_timeout_worker, tmp_path / "ck")


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_index_that_would_run_code_is_refused(tiny_overrides, tmp_path):
    """Checksums are no defence against someone who can write the checkpoint: they can rewrite the manifest too.
    The index's unpickler is."""
    path, overrides = _saved(tiny_overrides, tmp_path)
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(tmp_path / "pwned")))
    records = {f.name: FileRecord(f.stat().st_size, file_digest(f)) for f in path.iterdir() if f.name != MANIFEST_FILE}
    write_manifest(path, records)
    with pytest.raises(ConfigError, match=r"refers to (posix|os)\.system, which a checkpoint index never holds"):
        Trainer(load_config("tiny_dense", overrides), ParallelDims.single(), torch.device("cpu"))
    assert not (tmp_path / "pwned").exists()


def test_a_truncated_shard_file_gives_one_clear_error_naming_it(tiny_overrides, tmp_path):
    path, overrides = _saved(tiny_overrides, tmp_path)
    shard = path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ConfigError, match=r"step_00000001/__0_0.distcp has \d+ bytes, \d+ were written: it is "
                                          r"truncated or damaged") as err:
        Trainer(load_config("tiny_dense", overrides), ParallelDims.single(), torch.device("cpu"))
    assert "\n" not in str(err.value)


def test_an_incomplete_sharded_checkpoint_is_skipped_or_named(tiny_overrides, tmp_path):
    path, overrides = _saved(tiny_overrides, tmp_path)
    (path / "meta.pt").unlink()  # as if rank 0 died before finishing
    assert find_latest(tmp_path / "ck") is None  # `auto` does not resume from it
    with pytest.raises(ConfigError, match=r"step_00000001/meta.pt is missing"):
        Trainer(load_config("tiny_dense", overrides + [f"checkpoint.resume={path}"]), ParallelDims.single(),
                torch.device("cpu"))


# ------------------------------------------------------------------------------------- vocabulary

DEFAULT_VOCAB_TP_MODEL = [o for o in TP_MODEL if not o.startswith("model.vocab_size")]


def _save_at_tp2_worker(rank, world, overrides, out_path):
    cfg = load_config("tiny_dense", overrides)
    trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel), torch.device("cpu"))
    for _ in range(3):
        trainer.train_step()
    trainer.save()
    val = trainer.evaluate()
    if rank == 0:
        torch.save({"val": val, "vocab": trainer.model_cfg.vocab_size}, out_path)


def test_a_tp2_checkpoint_resumes_at_tp1_with_the_default_vocabulary(tiny_overrides, tmp_path):
    """0800a78 padded the vocabulary to 128 x tp (512 rows at TP=2, 384 at TP=1), so this failed unless
    model.vocab_size was set, with advice that did not work."""
    base = tiny_overrides + DEFAULT_VOCAB_TP_MODEL + [f"checkpoint.dir={tmp_path / 'ck'}"]
    spawn(2, _save_at_tp2_worker, base + ["parallel.tp=2", "checkpoint.resume=none"], tmp_path / "tp2.pt")
    tp2 = torch.load(tmp_path / "tp2.pt")
    one = Trainer(load_config("tiny_dense", base), ParallelDims.single(), torch.device("cpu"))
    assert one.step == 3 and one.model_cfg.vocab_size == tp2["vocab"] == 384
    assert math.isclose(one.evaluate(), tp2["val"], rel_tol=1e-5)


def test_a_checkpoint_with_another_vocabulary_names_the_setting_that_loads_it(tiny_overrides, tmp_path):
    ckpt = [f"checkpoint.dir={tmp_path / 'ck'}"]
    saved = Trainer(load_config("tiny_dense", tiny_overrides + ckpt + ["model.vocab_size=512"]), ParallelDims.single(),
                    torch.device("cpu"))
    saved.save()
    saved.run_lock.release()  # this process is done with that run: another run reads its checkpoints
    other = ckpt + ["run_name=other"]  # a run of its own over the same checkpoint directory
    with pytest.raises(ConfigError, match=r"the checkpoint's vocabulary has 512 rows .*: set model.vocab_size to that"):
        Trainer(load_config("tiny_dense", tiny_overrides + other), ParallelDims.single(), torch.device("cpu"))
    resumed = Trainer(load_config("tiny_dense", tiny_overrides + other + ["model.vocab_size=512"]),
                      ParallelDims.single(), torch.device("cpu"))  # the advice works
    assert resumed.step == 0 and resumed.model_cfg.vocab_size == 512
