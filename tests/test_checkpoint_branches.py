"""Checkpoints of branches a run left: going back to an earlier checkpoint points `latest` at it, the other branch's
checkpoints are passed over and set aside as `step_N.abandoned` once the run's saves pass them, and conversions into a
run's own checkpoint directory never move `latest` off the run's branch, delete another checkpoint or revive a set-aside
one, and hold the run's lock while they write (`docs/checkpoints.md`)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from megafp8.checkpoint import find_latest, load_checkpoint
from megafp8.checkpoint.local import fresh_temporary, publish, resume_candidates, verify_checkpoint
from megafp8.config import ConfigError
from megafp8.checkpoint.lock import LOCK_FILE, lock_for_conversion
from tests.checkpoints import flip_byte, one_rank_trainer
from tests.conftest import REPO


def test_newer_checkpoints_than_latest_are_never_resumed_or_pruned(saved, tmp_path):
    """After resuming from an earlier step, `latest` goes back; the abandoned later checkpoint is neither resumed
    nor counted by keep_last pruning (0800a78 pruned by name: the one just written could go)."""
    ckpt = shutil.copytree(saved["full"], tmp_path / "ck")
    state = load_checkpoint(ckpt / "step_00000001")
    (ckpt / "step_00000002").rename(ckpt / "step_00000009")  # from a run that later went back to step 1
    tmp = fresh_temporary(ckpt, 2)
    shutil.copytree(saved["full"] / "step_00000002", tmp, dirs_exist_ok=True)
    assert publish(ckpt, tmp, 2, keep_last=1) == ckpt / "step_00000002"
    assert sorted(p.name for p in ckpt.iterdir()) == [".lock", "latest", "step_00000002", "step_00000009"]
    assert find_latest(ckpt).name == "step_00000002" and state["step"] == 1
    candidates, passed_over = resume_candidates(ckpt)  # the newer complete one is passed over, and said to be
    assert [p.name for p in candidates] == ["step_00000002"]
    assert passed_over == [f"{ckpt / 'step_00000009'} is complete but newer than step_00000002, which "
                           f"{ckpt / 'latest'} names (a run that went back to an earlier step left it); to resume "
                           f"from it, set checkpoint.resume={ckpt / 'step_00000009'}"]


def _publish_copy(saved, ckpt, step: int, keep_last: int):
    """Publish a copy of step 2's checkpoint as `step` (what a save writes, without a trainer)."""
    tmp = fresh_temporary(ckpt, step)
    shutil.copytree(saved["full"] / "step_00000002", tmp, dirs_exist_ok=True)
    return publish(ckpt, tmp, step, keep_last=keep_last)


def test_a_branch_left_by_going_back_is_set_aside_once_the_run_passes_it(saved, tmp_path, caplog):
    """A run saved steps 1 and 6, then went back to step 1 with another checkpoint.interval (4). Its saves of steps
    4 and 8 never replaced the abandoned step 6; once `latest` passed it, step 6 read as the run's own: `keep_last=2`
    kept it and deleted step 4, and where step 8 failed to verify `auto` resumed the abandoned branch's step 6."""
    ckpt = shutil.copytree(saved["full"], tmp_path / "ck")
    (ckpt / "step_00000002").rename(ckpt / "step_00000006")
    (ckpt / "latest").write_text("step_00000006\n")  # the first branch's newest; the relaunch resumes step 1
    _publish_copy(saved, ckpt, 4, keep_last=2)
    assert [p.name for p in resume_candidates(ckpt)[0]] == ["step_00000004", "step_00000001"]  # 6 passed over
    with caplog.at_level("WARNING", logger="megafp8"):
        _publish_copy(saved, ckpt, 8, keep_last=2)
    assert sorted(p.name for p in ckpt.iterdir()) == [".lock", "latest", "step_00000004", "step_00000006.abandoned",
                                                      "step_00000008"]
    assert "step_00000006 renamed step_00000006.abandoned: a run that went back" in caplog.text
    (ckpt / "step_00000008" / "state.pt").write_bytes(b"damaged")
    candidates, passed_over = resume_candidates(ckpt)
    assert [p.name for p in candidates] == ["step_00000004"] and len(passed_over) == 1
    assert load_checkpoint(ckpt / "step_00000006.abandoned")["step"] == 2  # still resumable by its path
    (ckpt / "latest").write_text("step_00000004\n")  # back to step 4; that branch saved step 6 too, then left it
    shutil.copytree(ckpt / "step_00000004", ckpt / "step_00000006")
    _publish_copy(saved, ckpt, 7, keep_last=0)
    assert sorted(p.name for p in ckpt.glob("step_00000006*")) == ["step_00000006.abandoned",
                                                                   "step_00000006.abandoned-2"]


def _names(ckpt) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir())


def test_set_aside_checkpoints_are_pruned_once_keep_last_of_the_run_s_own_are_newer(saved, tmp_path, caplog):
    """`step_N.abandoned` checkpoints were never pruned: a run that went back again and again (after loss spikes,
    with another checkpoint.interval, or past a checkpoint a stop on a signal saved between intervals) kept every
    branch it left, and filled its disk. Each is now deleted, with a warning, by the save that makes `keep_last` of
    the run's own checkpoints newer than it (as one of the run's own at its step would be), never sooner."""
    ckpt = shutil.copytree(saved["full"], tmp_path / "ck")
    (ckpt / "step_00000002").rename(ckpt / "step_00000002.abandoned")  # the branch the run left going back to step 1
    shutil.copytree(ckpt / "step_00000001", ckpt / "step_00000002.abandoned-2")  # and another it left there later
    (ckpt / "latest").write_text("step_00000001\n")
    _publish_copy(saved, ckpt, 3, keep_last=2)  # only one of the run's own is newer: both kept
    assert _names(ckpt) == [".lock", "latest", "step_00000001", "step_00000002.abandoned", "step_00000002.abandoned-2",
                            "step_00000003"]
    with caplog.at_level("WARNING", logger="megafp8"):
        _publish_copy(saved, ckpt, 4, keep_last=2)
    assert _names(ckpt) == [".lock", "latest", "step_00000003", "step_00000004"]
    for aside in ("step_00000002.abandoned", "step_00000002.abandoned-2"):
        assert (f"deleted {ckpt / aside}, set aside from a branch the run left: 2 of the run's own checkpoints are "
                "newer (checkpoint.keep_last=2)") in caplog.text
    (ckpt / "step_00000003").rename(ckpt / "step_00000003.abandoned")
    _publish_copy(saved, ckpt, 9, keep_last=0)  # keep_last 0 keeps every checkpoint, set aside or not
    assert _names(ckpt) == [".lock", "latest", "step_00000003.abandoned", "step_00000004", "step_00000009"]


def test_a_run_going_back_again_and_again_keeps_a_bounded_number_of_set_aside_checkpoints(saved, tmp_path):
    """Each time, the run left a checkpoint of the branch it went back from, which its next save set aside: before,
    one more `step_N.abandoned` per going back, for the life of the run."""
    ckpt = shutil.copytree(saved["full"], tmp_path / "ck")
    (ckpt / "latest").write_text("step_00000002\n")
    for step in range(2, 20, 2):  # the run at `step` saves step + 1, goes back to `step`, saves step + 2
        shutil.copytree(ckpt / f"step_{step:08d}", ckpt / f"step_{step + 1:08d}")
        _publish_copy(saved, ckpt, step + 2, keep_last=2)
        # the one set aside a going back before is deleted: both of the run's own checkpoints are newer
        assert _names(ckpt)[2:] == [f"step_{step:08d}", f"step_{step + 1:08d}.abandoned", f"step_{step + 2:08d}"]


def test_a_launch_going_back_points_latest_at_its_checkpoint(saved, tiny_overrides, tmp_path, caplog):
    """A run saved steps 1, 2 and 4; a launch went back to step 1 and saved step 3. `latest` still named step 4 at
    that save, so the first branch's step 2, below it, read as this run's own: `keep_last=2` kept it and deleted step
    1. The launch now points `latest` at the checkpoint it resumes, and step 2 is set aside at the save of step 3."""
    ckpt = shutil.copytree(saved["full"], tmp_path / "ck")
    shutil.copytree(ckpt / "step_00000002", ckpt / "step_00000004")
    (ckpt / "latest").write_text("step_00000004\n")
    with caplog.at_level("WARNING", logger="megafp8"):
        trainer = one_rank_trainer(tiny_overrides + [f"logging.output_dir={tmp_path / 'runs'}", "run_name=b",
                                             f"checkpoint.dir={ckpt}", f"checkpoint.resume={ckpt / 'step_00000001'}",
                                             "checkpoint.keep_last=2", "checkpoint.format=full"])
        assert trainer.step == 1 and (ckpt / "latest").read_text() == "step_00000001\n"
        assert "the newer checkpoint(s) step_00000002, step_00000004 are passed over" in caplog.text
        assert f"to go on from the newest instead, relaunch with checkpoint.resume={ckpt / 'step_00000004'})" \
            in caplog.text
        for _ in range(2):
            trainer.train_step()
        trainer.save()
    trainer.run_lock.release()
    assert sorted(p.name for p in ckpt.iterdir()) == [".lock", "latest", "step_00000001", "step_00000002.abandoned",
                                                      "step_00000003", "step_00000004"]
    assert [p.name for p in resume_candidates(ckpt)[0]] == ["step_00000003", "step_00000001"]


def test_auto_falling_back_past_a_checkpoint_leaves_latest_for_the_next_launch(saved, tiny_overrides, tmp_path):
    """`auto` passed over step 2, which failed to verify (here a flipped byte; also a read gone wrong on one node of
    the job, or a file system not yet settled), resumed step 1 and pointed `latest` at it; the launch then failed
    before its first save (that node again), and its requeue took step 1 without trying step 2, now newer than
    `latest` ("left by a run that went back"): its saves from there replaced the run's own newer checkpoints."""
    ckpt = shutil.copytree(saved["sharded"], tmp_path / "ck")
    flip_byte(ckpt / "step_00000002" / "__0_0.distcp", 12345)
    failed = one_rank_trainer(tiny_overrides + [f"checkpoint.dir={ckpt}"])
    assert failed.step == 1
    failed.run_lock.release()  # (the launch fails before it saves)
    flip_byte(ckpt / "step_00000002" / "__0_0.distcp", 12345)  # that read's fault is gone
    assert (ckpt / "latest").read_text() == "step_00000002\n"
    requeued = one_rank_trainer(tiny_overrides + [f"checkpoint.dir={ckpt}"])
    requeued.run_lock.release()
    assert requeued.step == 2


def test_a_launch_resuming_a_set_aside_checkpoint_sets_aside_the_branch_it_leaves(saved, tiny_overrides, tmp_path,
                                                                                    caplog):
    """`checkpoint.resume=.../step_2.abandoned` (what a set-aside checkpoint's warning offers) into the run's own
    directory, whose branch it left had saved step 3 (`latest`): `latest` stayed at step 3, so the save of step 4
    passed it with nothing between the two to set aside, and step 3, of the branch this launch left, read as this
    run's own from then on (`keep_last` kept it, `auto` resumed it where step 4 failed to verify)."""
    ckpt = shutil.copytree(saved["full"], tmp_path / "ck")
    (ckpt / "step_00000002").rename(ckpt / "step_00000002.abandoned")
    shutil.copytree(ckpt / "step_00000001", ckpt / "step_00000003")  # the branch that went back to step 1 and on
    (ckpt / "latest").write_text("step_00000003\n")
    with caplog.at_level("WARNING", logger="megafp8"):
        trainer = one_rank_trainer(tiny_overrides + [f"logging.output_dir={tmp_path / 'runs'}", "run_name=b",
                                             f"checkpoint.dir={ckpt}",
                                             f"checkpoint.resume={ckpt / 'step_00000002.abandoned'}",
                                             "checkpoint.keep_last=0", "checkpoint.format=full"])
        assert trainer.step == 2
        for _ in range(2):
            trainer.train_step()
        trainer.save()
    trainer.run_lock.release()
    assert [p.name for p in resume_candidates(ckpt)[0]] == ["step_00000004", "step_00000001"]
    assert sorted(p.name for p in ckpt.iterdir()) == [".lock", "latest", "step_00000001", "step_00000002.abandoned",
                                                      "step_00000003.abandoned", "step_00000004"]
    assert "step_00000003 renamed step_00000003.abandoned" in caplog.text


@pytest.mark.parametrize("form", ["sharded", "full"])
def test_a_step_converted_into_a_run_s_own_directory_leaves_latest_at_the_newer_one(saved, tmp_path, form):
    """`consolidate ckpt/step_1 --out ckpt --overwrite` pointed `latest` back at step 1: the next relaunch resumed
    from there, and its saves replaced the newer checkpoints."""
    from megafp8.checkpoint.convert import consolidate, shard

    ckpt = shutil.copytree(saved[form], tmp_path / "ck")
    (consolidate if form == "sharded" else shard)(ckpt / "step_00000001", ckpt)  # the other form, in place
    assert (ckpt / "latest").read_text() == "step_00000002\n" and find_latest(ckpt).name == "step_00000002"
    assert verify_checkpoint(ckpt / "step_00000001")
    fresh = tmp_path / "fresh"
    consolidate(ckpt / "step_00000001", fresh)  # a directory of its own: latest names what was written
    assert (fresh / "latest").read_text() == "step_00000001\n"


def test_a_conversion_into_a_run_s_own_directory_never_moves_latest_off_the_run_s_branch(saved, tmp_path, caplog):
    """A conversion published into a run's directory pointed `latest` at the converted step wherever `latest` did not
    name a newer complete checkpoint: a run gone back to step 1 had its abandoned step 2 (converted in place, to change
    its form) resumed by its next relaunch; and where `latest` named a newer step left incomplete, `latest` went back
    to the converted step 1 and `auto` passed over the run's complete step 2."""
    from megafp8.checkpoint.convert import shard

    ckpt = shutil.copytree(saved["full"], tmp_path / "ck")
    (ckpt / "latest").write_text("step_00000001\n")  # the run went back to step 1; step 2 is the branch it left
    with caplog.at_level("WARNING", logger="megafp8"):
        shard(ckpt / "step_00000002", ckpt)
    assert (ckpt / "latest").read_text() == "step_00000001\n"
    assert [p.name for p in resume_candidates(ckpt)[0]] == ["step_00000001"]
    assert "passes this newer step over" in caplog.text
    ckpt = shutil.copytree(saved["full"], tmp_path / "ck2")
    shutil.copytree(ckpt / "step_00000002", ckpt / "step_00000003")
    (ckpt / "step_00000003" / "state.pt").unlink()  # its save was cut short (a file system's quota)
    (ckpt / "latest").write_text("step_00000003\n")
    shard(ckpt / "step_00000001", ckpt)  # the other form, in place
    assert [p.name for p in resume_candidates(ckpt)[0]] == ["step_00000002", "step_00000001"]
    fresh = tmp_path / "fresh"  # a directory of its own, or one without `latest`: it names the newest
    shard(ckpt / "step_00000001", fresh)
    assert (fresh / "latest").read_text() == "step_00000001\n"
    (fresh / "latest").unlink()
    shutil.copytree(ckpt / "step_00000002", fresh / "step_00000002")
    (fresh / "step_00000001").rename(tmp_path / "one")
    shard(tmp_path / "one", fresh)  # step 2 is newer: `latest` would have passed it over
    assert not (fresh / "latest").exists() and find_latest(fresh).name == "step_00000002"


def test_a_conversion_never_deletes_another_checkpoint_or_revives_a_set_aside_one(saved, tmp_path):
    """`consolidate ck/step_2.abandoned --out ck --overwrite` published it as step_2 again, read as the run's own
    (`auto` resumed it where a newer one failed to verify, `keep_last` kept it); converting another run's step N into
    a directory holding a step N deleted that checkpoint."""
    from megafp8.checkpoint.convert import consolidate, export_hf, shard

    ckpt = shutil.copytree(saved["full"], tmp_path / "ck")
    (ckpt / "step_00000002").rename(ckpt / "step_00000002.abandoned")
    shutil.copytree(ckpt / "step_00000001", ckpt / "step_00000004")  # the run's own, past it
    (ckpt / "latest").write_text("step_00000004\n")
    for convert in (consolidate, shard):
        with pytest.raises(ConfigError, match="set aside by a run that left its branch"):
            convert(ckpt / "step_00000002.abandoned", ckpt)
    assert [p.name for p in resume_candidates(ckpt)[0]] == ["step_00000004", "step_00000001"]
    consolidate(ckpt / "step_00000002.abandoned", tmp_path / "elsewhere")  # fine in a directory of its own
    other = shutil.copytree(saved["sharded"], tmp_path / "other")
    before = (ckpt / "step_00000001" / "state.pt").read_bytes()
    with pytest.raises(ConfigError, match="already holds step_00000001, another checkpoint"):
        consolidate(other / "step_00000001", ckpt)
    assert (ckpt / "step_00000001" / "state.pt").read_bytes() == before
    shard(ckpt / "step_00000001", ckpt)  # the same checkpoint in the other form: replaced in place
    assert verify_checkpoint(ckpt / "step_00000001")
    for out in (ckpt / "step_00000001", ckpt / "step_00000001" / "hf"):  # was written into it: not in its manifest,
        for convert in (consolidate, shard, lambda c, o: export_hf(c, o, fp8=False)):  # and pruned with it
            with pytest.raises(ConfigError, match="is inside the checkpoint"):
                convert(ckpt / "step_00000001", out)
    assert sorted(p.name for p in (ckpt / "step_00000001").iterdir()) == sorted(
        p.name for p in (saved["sharded"] / "step_00000001").iterdir())


def test_a_conversion_into_a_live_run_s_checkpoint_directory_is_refused_and_holds_it_while_it_writes(saved, tmp_path):
    """Conversions took no lock: `consolidate ... --out <a training run's checkpoints>` published beside the run's
    saves and pruning, and a run launched meanwhile started in the directory being written. Now a conversion into a
    directory holding a run's lock file takes that lock for its duration, and is refused while a run holds it."""
    ckpt = shutil.copytree(saved["sharded"], tmp_path / "ck")
    (ckpt / LOCK_FILE).touch()  # a run's checkpoint directory
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from megafp8.checkpoint.lock import RunLock; held = RunLock([Path(sys.argv[1])]); "
                               "print('locked', flush=True); time.sleep(120)", str(ckpt)],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        command = [sys.executable, "tools/convert_checkpoint.py", "consolidate", str(ckpt / "step_00000001"),
                   "--out", str(ckpt), "--overwrite"]
        refused = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.strip().startswith(f"error: {ckpt} is in use by another run (pid {holder.pid} on ")
        assert "convert into another --out" in refused.stderr and "Traceback" not in refused.stderr
        assert sorted(p.name for p in (ckpt / "step_00000001").iterdir()) == sorted(
            p.name for p in (saved["sharded"] / "step_00000001").iterdir())  # untouched
    finally:
        holder.kill()
        holder.wait()
    with lock_for_conversion(ckpt):  # no run there now: the conversion holds the directory while it writes
        child = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                                "from megafp8.checkpoint.lock import RunLock; RunLock([Path(sys.argv[1])])",
                                str(ckpt)], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert child.returncode != 0 and f"is in use by another run (pid {os.getpid()} on " in child.stderr
    with lock_for_conversion(tmp_path) as lock:
        assert lock is None  # a directory of the conversion's own: nothing to hold


# A process that locks a lock file as a run does (`fcntl.lockf`), names itself in it and holds it; and one that only
# tries to take it (exit status 1 while another process holds it). Neither imports torch: they start in milliseconds.
_HOLD = ("import fcntl, os, sys, time; f = open(sys.argv[1], 'a+'); fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB); "
         "f.write(f'pid {os.getpid()} on node7, since 10:00'); f.flush(); print('locked', flush=True); time.sleep(120)")
_TRY = "import fcntl, sys; fcntl.lockf(open(sys.argv[1], 'a+'), fcntl.LOCK_EX | fcntl.LOCK_NB)"


def test_conversions_called_from_python_hold_the_run_s_lock_too(saved, tmp_path, monkeypatch):
    """Only the tool took the lock: the library's `consolidate`, `shard` and `import_hf`, called from Python into a
    training run's checkpoint directory, published beside its saves, pruning and `latest` pointer. They take the
    run's lock themselves now: refused in one line while a run holds it, and holding it while they write."""
    from megafp8.checkpoint import convert

    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    (ckpt / LOCK_FILE).touch()  # a run's checkpoint directory (its first save still to come)
    convert.export_hf(saved["full"] / "step_00000001", tmp_path / "hf", fp8=False)
    conversions = {"consolidate": lambda: convert.consolidate(saved["sharded"] / "step_00000001", ckpt),
                   "shard": lambda: convert.shard(saved["full"] / "step_00000002", ckpt),
                   "import_hf": lambda: convert.import_hf(tmp_path / "hf", ckpt)[0]}
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(ckpt / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        for name, conversion in conversions.items():
            with pytest.raises(ConfigError) as err:
                conversion()
            assert str(err.value).startswith(f"{ckpt} is in use by another run (pid {holder.pid} on node7, "), name
            assert "convert into another --out" in str(err.value) and "\n" not in str(err.value), name
        assert sorted(p.name for p in ckpt.iterdir()) == [".lock"]  # nothing written
    finally:
        holder.kill()
        holder.wait()

    held = []  # for each write: whether another process could take the lock meanwhile (1: it could not)

    def tried(write):
        def write_and_try(root, *args, **kwargs):
            held.append(subprocess.run([sys.executable, "-c", _TRY, str(root / ".lock")]).returncode)
            return write(root, *args, **kwargs)
        return write_and_try
    monkeypatch.setattr(convert, "save_checkpoint", tried(convert.save_checkpoint))
    monkeypatch.setattr(convert, "publish", tried(convert.publish))
    written = [conversion().name for conversion in conversions.values()]
    assert written == ["step_00000001", "step_00000002", "step_00000000"] and held == [1, 1, 1]
    assert subprocess.run([sys.executable, "-c", _TRY, str(ckpt / ".lock")]).returncode == 0  # released after each
