"""Nothing lost: checksums recorded while a checkpoint is written and verified before it is read, `auto` resume
falling back past damaged checkpoints, private temporary directories, safe pruning, the verify tool, and one
writer per run directory."""
from __future__ import annotations

import errno
import multiprocessing
import os
import shutil
import subprocess
import sys

import pytest
import torch

from megafp8.checkpoint import find_latest, list_checkpoints, load_checkpoint
from megafp8.checkpoint.local import (fresh_temporary, publish, remove_leftovers, resume_candidates,
                                      verification_problem, verify_checkpoint)
from megafp8.checkpoint.lock import RunLock
from megafp8.config import ConfigError, load_config
from megafp8.parallel import ParallelDims
from megafp8.train import Trainer
from megafp8.train.run_lock import _directories
from tests.checkpoints import flip_byte, one_rank_trainer
from tests.conftest import REPO, torchrun_env
from tests.distributed import spawn

@pytest.mark.parametrize("form, name", [("sharded", "__0_0.distcp"), ("sharded", ".metadata"), ("sharded", "meta.pt"),
                                        ("sharded", "checksums.json"), ("full", "state.pt"), ("full", "checksums.json")])
def test_a_flipped_byte_in_any_checkpoint_file_is_named_in_one_line(saved, tmp_path, form, name):
    """Before checksums, all of these loaded without a word (meta.pt's step 10 read as 11, a shard's values...)."""
    good = saved[form] / "step_00000002"
    assert verify_checkpoint(good).startswith(f"{good}: ")
    size = (good / name).stat().st_size
    for i, offset in enumerate([0, size // 3, size // 2, size - 2]):
        damaged = shutil.copytree(good, tmp_path / f"copy{i}")
        flip_byte(damaged / name, offset)
        with pytest.raises(ConfigError) as err:
            load_checkpoint(damaged)
        message = str(err.value)
        assert f"{damaged / name} " in message and "\n" not in message, message
        assert "checksum" in message or "corrupt" in message, message


def test_auto_falls_back_past_a_damaged_checkpoint_and_says_so(saved, tiny_overrides, tmp_path, caplog):
    ckpt = shutil.copytree(saved["sharded"], tmp_path / "ck")
    flip_byte(ckpt / "step_00000002" / "__0_0.distcp", 12345)
    with caplog.at_level("WARNING", logger="megafp8"):
        resumed = one_rank_trainer(tiny_overrides + [f"checkpoint.dir={ckpt}"])
    assert resumed.step == 1  # 0800a78 resumed from the damaged step 2
    assert "step_00000002/__0_0.distcp fails its checksum" in caplog.text
    assert "resuming from" in caplog.text and "step_00000001, the newest checkpoint that verifies" in caplog.text
    resumed.train_step()
    resumed.save()  # step 2 again, in place of the damaged one
    assert find_latest(ckpt).name == "step_00000002" and verify_checkpoint(ckpt / "step_00000002")


def test_auto_never_restarts_a_damaged_run_from_step_0(saved, tiny_overrides, tmp_path):
    """0800a78 started from step 0 (and later overwrote the checkpoint) when the only one lacked meta.pt."""
    ckpt = tmp_path / "ck"
    shutil.copytree(saved["sharded"] / "step_00000002", ckpt / "step_00000002")
    (ckpt / "latest").write_text("step_00000002\n")
    (ckpt / "step_00000002" / "meta.pt").unlink()
    assert find_latest(ckpt) is None and list_checkpoints(ckpt) == []
    with pytest.raises(ConfigError, match=r"no checkpoint under .* can be resumed: checkpoint file .*step_00000002/"
                                          r"meta.pt is missing.*checkpoint.resume=none"):
        one_rank_trainer(tiny_overrides + [f"checkpoint.dir={ckpt}"])


def _unreadable_on_rank_1_worker(rank, world, checkpoint):
    from megafp8.checkpoint import integrity
    from megafp8.config import ParallelConfig
    from megafp8.train.resume import first_problem

    digest = integrity.file_digest

    def failing_read(path):
        raise OSError(errno.EIO, "Input/output error", str(path))

    # Rank 1 verifies every other file (`share_of`): one of them gives it an I/O error, as a bad disk sector would.
    integrity.file_digest = failing_read if rank == 1 else digest
    problem = first_problem(checkpoint, ParallelDims.from_config(ParallelConfig()))
    assert problem is not None and "cannot be read" in problem and "Input/output error" in problem, problem


def test_a_file_one_rank_cannot_read_fails_verification_on_every_rank(saved):
    """Each rank hashes its share of the files: an OSError on one of them used to end that rank alone, its peers
    left waiting in the gather of the verdicts. It is now one of the problems every rank sees."""
    spawn(2, _unreadable_on_rank_1_worker, saved["sharded"] / "step_00000002")


def _run_directory_unreadable_on_rank_0_worker(rank, world, overrides):
    from megafp8.train import run_history

    def unreadable(run_dir, *args):
        raise PermissionError(errno.EACCES, "Permission denied", str(run_dir))

    if rank == 0:  # the rank that alone reads what an earlier launch left
        run_history.read_earlier_run = unreadable
    cfg = load_config("tiny_dense", overrides)
    with pytest.raises(ConfigError, match="Permission denied"):
        Trainer(cfg, ParallelDims.from_config(cfg.parallel), torch.device("cpu"))


def test_a_run_directory_rank_0_cannot_read_is_one_error_on_every_rank(tiny_overrides, tmp_path):
    """Rank 0 alone judges an earlier launch and lists the checkpoints to resume: an OSError there ended rank 0 with a
    traceback and left its peers waiting in the broadcast of its verdict."""
    spawn(2, _run_directory_unreadable_on_rank_0_worker, tiny_overrides + [f"logging.output_dir={tmp_path}"])


def _rank_0_fails_otherwise_worker(rank, world):
    from megafp8.config import ParallelConfig
    from megafp8.train.resume import from_rank0

    def judge():
        raise ValueError("metrics.jsonl line 7 is not JSON")

    dims = ParallelDims.from_config(ParallelConfig())
    if rank == 0:  # its own error, with its own traceback
        with pytest.raises(ValueError, match="line 7 is not JSON"):
            from_rank0(judge, dims)
    else:  # told, not left waiting in the broadcast
        with pytest.raises(RuntimeError, match="rank 0 failed.*ValueError: metrics.jsonl line 7 is not JSON"):
            from_rank0(judge, dims)
    assert from_rank0(lambda: ("fine", 3), dims) == ("fine", 3)  # and the ranks are still in step


def test_any_other_failure_of_rank_0_alone_reaches_every_rank():
    """What rank 0 alone computes for every rank may fail in ways that are neither a ConfigError nor an OSError (a
    bug, a file it cannot parse): rank 0 raises it as it came, and its peers, instead of waiting in the broadcast
    until the process group's timeout, raise an error that names it."""
    spawn(2, _rank_0_fails_otherwise_worker)


def _run_directory_unwritable_on_rank_0_worker(rank, world, overrides, where):
    from megafp8.checkpoint import lock
    from megafp8.train import run_lock

    def failing(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "runs/t/.lock")

    if rank == 0:  # the rank that alone locks and prepares the run directories
        if where == "claim":  # checking for a lock file (its stat)
            lock._lock = failing
        elif where == "open":  # naming the holder in the lock file it created
            lock.RunLock.note_holder = failing
        else:  # removing what interrupted saves left
            run_lock.remove_leftovers = failing
    cfg = load_config("tiny_dense", overrides)
    with pytest.raises(ConfigError, match=r"rank 0 could not .* run directories .*No space left on device.*: point "
                                          r"logging.output_dir \(or checkpoint.dir\) at a directory"):
        Trainer(cfg, ParallelDims.from_config(cfg.parallel), torch.device("cpu"))


@pytest.mark.parametrize("where", ["claim", "open", "leftovers"])
def test_a_run_directory_rank_0_cannot_lock_or_prepare_is_one_error_on_every_rank(tiny_overrides, tmp_path, where):
    """Rank 0 alone locks and prepares the run directories: an OSError there (not a ConfigError) ended rank 0 with a
    traceback while its peers waited in the broadcast of its verdict (or, after it, in the next collective). Each
    rank here checks that the error reached it: a rank left waiting fails the test at once, when its peer's
    failure ends the spawn."""
    spawn(2, _run_directory_unwritable_on_rank_0_worker, tiny_overrides + [f"logging.output_dir={tmp_path}"], where)


def test_a_damaged_latest_pointer_falls_back_to_the_newest_complete_checkpoint(saved, tmp_path):
    ckpt = shutil.copytree(saved["full"], tmp_path / "ck")
    assert (ckpt / "latest").read_text() == "step_00000002\n"
    (ckpt / "latest").write_text("step_0000000\x02\n")  # a flipped bit in the pointer itself
    assert find_latest(ckpt).name == "step_00000002"
    (ckpt / "latest").write_bytes(b"garbage\x00\xff")  # not even text: was UnicodeDecodeError's traceback
    assert find_latest(ckpt).name == "step_00000002"


def test_a_step_saved_again_killed_while_replacing_keeps_a_complete_checkpoint_of_it(saved, tmp_path, monkeypatch):
    """Saving a step that exists already (after going back to an earlier one) replaces its directory. The old one
    used to be deleted first, the new one still under its temporary name: killed during that deletion (long for a
    large checkpoint), the step had no checkpoint left, and the next start removed the complete new one as a
    leftover."""
    ckpt = shutil.copytree(saved["full"], tmp_path / "ck")
    tmp = fresh_temporary(ckpt, 2)
    shutil.copytree(saved["full"] / "step_00000002", tmp, dirs_exist_ok=True)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed while deleting the replaced checkpoint")

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        publish(ckpt, tmp, 2, keep_last=0)
    monkeypatch.undo()
    remove_leftovers(ckpt)  # what the next start does first
    assert find_latest(ckpt) == ckpt / "step_00000002"
    assert verify_checkpoint(ckpt / "step_00000002")


def test_the_names_of_a_checkpoints_files_are_durable_before_latest_names_it(saved, tmp_path, monkeypatch):
    """Each file's bytes were fsynced, and the checkpoint root after the rename, but never the directory holding the
    files' names: after a power loss `latest` could name a directory whose files are not there."""
    ckpt = shutil.copytree(saved["full"], tmp_path / "ck")
    tmp = fresh_temporary(ckpt, 3)
    shutil.copytree(saved["full"] / "step_00000002", tmp, dirs_exist_ok=True)
    synced, real_fsync = [], os.fsync

    def recording_fsync(fd):
        synced.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    directory = tmp.stat().st_ino  # a rename keeps the inode
    latest_before = (ckpt / "latest").stat().st_ino
    publish(ckpt, tmp, 3, keep_last=0)
    latest = (ckpt / "latest").stat().st_ino  # the new pointer file, fsynced before it replaced the old one
    assert latest != latest_before and directory in synced and synced.index(directory) < synced.index(latest)


def test_a_pointer_the_disk_has_no_room_for_fails_the_save_before_it_publishes(saved, tmp_path, monkeypatch):
    """`latest` was written after the rename: a full disk (or an inode quota) there left step 3 complete beside a
    `latest` naming step 2, under an error saying step 3 was not saved, and a relaunch passed step 3 over as left by
    a run that went back to an earlier step (to be replaced by its saves)."""
    from megafp8.checkpoint import local

    ckpt = shutil.copytree(saved["full"], tmp_path / "ck")
    tmp = fresh_temporary(ckpt, 3)
    shutil.copytree(saved["full"] / "step_00000002", tmp, dirs_exist_ok=True)

    def full_disk(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(local, "open", full_disk, raising=False)  # the pointer's file, the one `open` there
    with pytest.raises(OSError, match="No space left"):
        publish(ckpt, tmp, 3, keep_last=0)
    monkeypatch.undo()
    assert not (ckpt / "step_00000003").exists() and tmp.is_dir()  # unpublished: a leftover, as the error says
    remove_leftovers(ckpt)  # what the next start does first
    candidates, passed_over = resume_candidates(ckpt)
    assert [p.name for p in candidates] == ["step_00000002", "step_00000001"] and passed_over == []


def test_an_interrupted_prune_never_leaves_a_checkpoint_that_looks_complete(saved, tmp_path):
    ckpt = shutil.copytree(saved["sharded"], tmp_path / "ck")
    (ckpt / "step_00000001" / "__0_0.distcp").unlink()  # what a prune killed midway used to leave
    assert [p.name for p in list_checkpoints(ckpt)] == ["step_00000002"]
    with pytest.raises(ConfigError, match=r"step_00000001/__0_0.distcp is missing"):
        load_checkpoint(ckpt / "step_00000001")


def test_auto_passes_over_a_checkpoint_without_checksums_that_lacks_a_shard_file(saved, tiny_overrides, tmp_path):
    """A sharded checkpoint without checksums.json (written before checksums, or copied without it) counted as
    complete with its index and meta.pt alone: `auto` took one whose shard file was missing (a copy cut short) and
    the run stopped in the load, instead of resuming the checkpoint before it."""
    ckpt = shutil.copytree(saved["sharded"], tmp_path / "ck")
    for step in ("step_00000001", "step_00000002"):
        (ckpt / step / "checksums.json").unlink()
    (ckpt / "step_00000002" / "__0_0.distcp").unlink()
    candidates, passed_over = resume_candidates(ckpt)
    assert [p.name for p in candidates] == ["step_00000001"]
    assert passed_over == [f"checkpoint file {ckpt / 'step_00000002' / '__0_0.distcp'} is missing"]
    assert one_rank_trainer(tiny_overrides + [f"checkpoint.dir={ckpt}"]).step == 1


def test_leftovers_of_interrupted_saves_are_removed_at_start(saved, tiny_overrides, tmp_path):
    ckpt = shutil.copytree(saved["sharded"], tmp_path / "ck")
    for name in ("step_00000003.tmp", "step_00000003.tmp-0123456789ab", "step_00000001.deleting-0123456789ab"):
        (ckpt / name).mkdir()
    (ckpt / "latest.tmp-0123456789ab").write_text("step_00000003\n")
    resumed = one_rank_trainer(tiny_overrides + [f"checkpoint.dir={ckpt}"])
    assert resumed.step == 2
    assert sorted(p.name for p in ckpt.iterdir()) == [".lock", "latest", "step_00000001", "step_00000002"]


def test_a_directory_of_checkpoints_given_as_a_checkpoint_names_its_newest(saved, tiny_overrides, tmp_path):
    """The checkpoint root or the run directory in place of a checkpoint was 'incomplete (no checksums.json: its
    save did not finish)', for the tools and for checkpoint.resume alike."""
    run_dir = tmp_path / "run"
    ckpt = shutil.copytree(saved["sharded"], run_dir / "checkpoints")
    newest = ckpt / "step_00000002"
    for given in (ckpt, run_dir):
        expected = f"{given} holds checkpoints but is not one: give one of them, e.g. {newest}"
        assert verification_problem(given) == expected
        with pytest.raises(ConfigError) as err:
            load_checkpoint(given)
        assert str(err.value) == expected
    with pytest.raises(ConfigError) as err:
        one_rank_trainer(tiny_overrides + [f"checkpoint.resume={ckpt}"])
    assert str(err.value) == f"checkpoint.resume: {ckpt} holds checkpoints but is not one: give one of them, e.g. " \
                             f"{newest}"
    with pytest.raises(ConfigError) as err:  # was "... lacks model, optimizer: not a megafp8 training checkpoint"
        one_rank_trainer(tiny_overrides + [f"checkpoint.resume={newest / 'meta.pt'}"])
    assert str(err.value) == f"{newest / 'meta.pt'} is one file of the sharded checkpoint {newest}: give that directory"
    stray = tmp_path / "notes.txt"
    stray.write_text("hello\n")
    with pytest.raises(ConfigError) as err:  # was "checkpoint <tmp_path> is incomplete (no checksums.json ...)"
        one_rank_trainer(tiny_overrides + [f"checkpoint.resume={stray}"])
    assert str(err.value) == (f"checkpoint.resume={stray} is a file, not a checkpoint: give a checkpoint's directory "
                              "(step_NNNNNNNN) or a full checkpoint's state.pt")
    for name in ("checksums.json", "meta.pt"):  # a step_N whose save did not finish is still only incomplete
        (newest / name).unlink()
    assert "is incomplete (no checksums.json" in verification_problem(newest)


def test_verify_tool_checks_without_building_a_model(saved, tmp_path):
    damaged = shutil.copytree(saved["sharded"] / "step_00000002", tmp_path / "step_00000002")
    flip_byte(damaged / "meta.pt", 100)
    cmd = [sys.executable, "tools/convert_checkpoint.py", "verify", str(saved["sharded"] / "step_00000001"),
           str(damaged)]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=torchrun_env(), timeout=120)
    assert result.returncode == 2
    assert "step_00000001: 3 files" in result.stdout and "every checksum matches" in result.stdout
    assert f"{damaged}: 1 problem:\n  checkpoint file {damaged / 'meta.pt'} fails its checksum (xxh3_64 " in \
        result.stdout
    assert result.stderr == f"error: 1 of 2 checkpoints failed verification, with 1 problem (listed above): {damaged}\n"


def test_verify_lists_every_problem_of_every_checkpoint(saved, tmp_path, capsys, monkeypatch):
    """verify stopped at the first bad file of the first bad checkpoint: the files and checkpoints after it went
    unchecked, and a user repairing from backups learned of one file at a time."""
    import tools.convert_checkpoint as tool

    damaged = shutil.copytree(saved["sharded"] / "step_00000002", tmp_path / "step_00000002")
    for name in (".metadata", "meta.pt"):
        flip_byte(damaged / name, 100)
    (damaged / "__0_0.distcp").unlink()
    absent, good = tmp_path / "step_00000009", saved["full"] / "step_00000001"
    assert tool.main(["verify", str(damaged), str(absent), str(good)]) == 2
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[:2] == [f"{damaged}: 3 problems:", f"  checkpoint file {damaged / '__0_0.distcp'} is missing"]
    for line, name in zip(lines[2:4], (".metadata", "meta.pt")):
        assert line.startswith(f"  checkpoint file {damaged / name} fails its checksum (xxh3_64 "), line
    assert lines[4:6] == [f"{absent}: 1 problem:", f"  checkpoint '{absent}' not found"]
    assert lines[6].startswith(f"{good}: 1 files, ") and lines[6].endswith(" s)") and len(lines) == 7
    assert err == (f"error: 2 of 3 checkpoints failed verification, with 4 problems (listed above): {damaged}, "
                   f"{absent}\n")
    monkeypatch.setattr(tool, "MAX_LISTED", 1)  # the listing is bounded, the rest counted
    assert tool.main(["verify", str(damaged)]) == 2
    assert capsys.readouterr().out.splitlines()[2:] == ["  ... and 2 more"]


# ------------------------------------------------------------------------------------- one writer

def _hold_lock(directory, ready, release, checkpoint_dir=None):
    lock = RunLock([directory] if checkpoint_dir is None else _directories(directory, checkpoint_dir))
    ready.set()
    release.wait(60)
    lock.release()


def test_a_second_run_in_a_locked_run_directory_is_refused(tiny_overrides, tmp_path):
    """0800a78 let two runs interleave their metrics and checkpoints in one directory."""
    run_dir = tmp_path / "runs" / "t"
    context = multiprocessing.get_context("spawn")
    ready, release = context.Event(), context.Event()
    holder = context.Process(target=_hold_lock, args=(run_dir, ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        with pytest.raises(ConfigError, match=rf"{run_dir} is in use by another run \(pid {holder.pid} on .*\): "
                                              "wait for it to end, or give this run another run_name"):
            one_rank_trainer(tiny_overrides)
        assert not (run_dir / "metrics.jsonl").exists()
    finally:
        release.set()
        holder.join(60)
    one_rank_trainer(tiny_overrides + ["training.steps=2", "training.eval_interval=0"]).fit()  # free again once the other run has ended
    assert (run_dir / "metrics.jsonl").is_file()


def test_a_run_pointed_at_another_running_run_s_checkpoints_is_refused(tiny_overrides, tmp_path):
    """Run B, its run directory its own, checkpoint.dir the running run A's checkpoints: it was not refused (only
    A's run directory was locked), resumed from A's checkpoint and removed A's save in flight as a leftover."""
    run_a = tmp_path / "runs" / "a"
    context = multiprocessing.get_context("spawn")
    ready, release = context.Event(), context.Event()
    holder = context.Process(target=_hold_lock, args=(run_a, ready, release, run_a / "checkpoints"))
    holder.start()
    try:
        assert ready.wait(60)
        in_flight = run_a / "checkpoints" / "step_00000008.tmp-0123456789ab"
        in_flight.mkdir()
        with pytest.raises(ConfigError, match=rf"{run_a / 'checkpoints'} is in use by another run \(pid "
                                              rf"{holder.pid} on .*\)"):
            one_rank_trainer(tiny_overrides + ["run_name=b", f"checkpoint.dir={run_a / 'checkpoints'}"])
        assert in_flight.is_dir() and not (tmp_path / "runs" / "b" / "metrics.jsonl").exists()
    finally:
        release.set()
        holder.join(60)


@pytest.mark.parametrize("form", ["sharded", "full"])
def test_a_tool_reads_only_the_tensors_it_needs(saved, form, monkeypatch):
    """An export reads the model and the FP32 masters, not the AdamW moments (two thirds of the checkpoint); an
    inspection reads no tensor at all (a 70B checkpoint's ~1 TB was read into memory to list its names)."""
    from megafp8.checkpoint import sharded
    from megafp8.checkpoint.convert import describe

    path = saved[form] / "step_00000002"
    everything = load_checkpoint(path)
    weights = load_checkpoint(path, tensors="weights")
    assert set(weights["optimizer"]) == {"step", "masters"} and weights["step"] == everything["step"]
    for name, t in everything["optimizer"]["masters"].items():
        assert torch.equal(weights["optimizer"]["masters"][name], t), name
    for name, t in everything["model"].items():
        assert torch.equal(weights["model"][name], t), name
    shapes = load_checkpoint(path, tensors="shapes")
    for part in ("model", "optimizer"):
        flat = everything[part] if part == "model" else everything[part]["exp_avg"]
        got = shapes[part] if part == "model" else shapes[part]["exp_avg"]
        assert {n: (t.shape, t.dtype) for n, t in flat.items()} == {n: (t.shape, t.dtype) for n, t in got.items()}
        assert all(t.device.type == "meta" for t in got.values())
    if form == "sharded":  # listing it reads no shard data
        monkeypatch.setattr(sharded, "_load", lambda *args, **kwargs: pytest.fail("read tensor data"))
    assert "| embed.weight | (384, 128) | bfloat16 | yes | yes |" in describe(path)
    with pytest.raises(ValueError, match="tensors='some'"):
        load_checkpoint(path, tensors="some")


def test_a_state_file_in_torchs_old_format_still_loads_in_part(saved, tmp_path):
    """`tensors="weights"` memory-maps the state file, which torch cannot do for its pre-zipfile format: such a file
    is read whole instead of being called corrupt (resuming, which reads it whole, took it)."""
    state = torch.load(saved["full"] / "step_00000002" / "state.pt", weights_only=True)
    (tmp_path / "old").mkdir()
    torch.save(state, tmp_path / "old" / "state.pt", _use_new_zipfile_serialization=False)
    weights = load_checkpoint(tmp_path / "old" / "state.pt", verify=False, tensors="weights")
    assert set(weights["optimizer"]) == {"step", "masters"}
    for name, t in state["optimizer"]["masters"].items():
        assert torch.equal(weights["optimizer"]["masters"][name], t), name
