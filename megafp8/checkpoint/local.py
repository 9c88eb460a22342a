"""Checkpoint directories: checksummed files, atomic and durable publish, keep-last-K (loading: `loading.py`).

A *full* checkpoint is one file that rank 0 writes after gathering every tensor at its full shape:

    DIR/step_00000100/state.pt         model, optimizer (FP32 masters + AdamW), step, loader position, RNG, config
    DIR/step_00000100/checksums.json   size and xxh3_64 digest of every file (`megafp8/checkpoint/integrity.py`)
    DIR/latest                         the name of the newest complete checkpoint

A *sharded* checkpoint (`checkpoint.format: sharded`, the default) has every rank write its own pieces
with torch.distributed.checkpoint (`megafp8/checkpoint/sharded.py`); `load_checkpoint` (`megafp8/checkpoint/loading.py`) reads either
form into the same full-tensor dictionary (for tools and tests).

A checkpoint is written into a directory private to its writer (`step_N.tmp-<random>`), its manifest
last; then the directory is renamed to `step_N` and `latest` replaced atomically, each step fsynced (the
files, the directory holding their names, the rename, the pointer). So
a save killed midway leaves the previous checkpoint intact and `latest` only ever names a checkpoint
whose every file was written and recorded. Pruning renames a directory aside before deleting it, so an
interrupted prune never leaves a `step_N` without some of its files. Loading verifies every file's
checksum first and uses `torch.load(weights_only=True)`: nothing in a file can execute code.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import torch

from megafp8.checkpoint.integrity import (
    MANIFEST_FILE,
    FileRecord,
    hashed_file,
    file_problems,
    quick_problem,
    read_manifest,
    share_of,
    verify_files,
    write_manifest,
)
from megafp8.checkpoint.sharded import INDEX_FILE, META_FILE, is_sharded_checkpoint, short_file_problem
from megafp8.config import ConfigError

log = logging.getLogger("megafp8")

STATE_FILE = "state.pt"
HF_SOURCE = "hf_source"  # checkpoint key: what `import_hf` keeps of config.json that no model setting holds
CARRIED_KEYS = (HF_SOURCE,)  # checkpoint keys a run resumed from a checkpoint passes on into its own checkpoints
LATEST_FILE = "latest"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
# What an interrupted save, prune or pointer update leaves behind (removed by `remove_leftovers`).
_LEFTOVER = re.compile(r"^(step_\d{8}\.tmp(-.*)?|.*\.deleting-.*|latest\.tmp.*)$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def save_checkpoint(root: Path, step: int, state: dict[str, Any], keep_last: int, latest_back: bool = True) -> Path:
    """Write `state` as checkpoint `step` under `root` (call on one rank only); returns its directory
    (`latest_back`: see `publish`)."""
    tmp = fresh_temporary(root, step)
    records: dict[str, FileRecord] = {}
    with hashed_file(tmp / STATE_FILE, records) as f:
        torch.save(state, f)
    write_manifest(tmp, records)
    return publish(root, tmp, step, keep_last, latest_back)


def fresh_temporary(root: Path, step: int) -> Path:
    """A new empty directory, private to this writer, that checkpoint `step` is written into before `publish`."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{step_dir_name(step)}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    return tmp


def _fsync_dir(directory: Path) -> None:
    """Make renames and new entries in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _set_aside(directory: Path) -> Path:
    """Rename a directory to a leftover's name (atomic), so an interruption never leaves it half-deleted under its
    own name; returns the new path, to delete."""
    doomed = directory.with_name(f"{directory.name}.deleting-{uuid.uuid4().hex[:12]}")
    directory.rename(doomed)
    return doomed


def _discard(directory: Path) -> None:
    """Delete a directory, set aside first."""
    shutil.rmtree(_set_aside(directory), ignore_errors=True)


def _prepared_pointer(root: Path, name: str) -> Path:
    """A temporary file naming checkpoint `name`, written and fsynced: `_replace_pointer` makes it `latest`."""
    tmp = root / f"{LATEST_FILE}.tmp-{uuid.uuid4().hex[:12]}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    return tmp


def _replace_pointer(root: Path, prepared: Path) -> None:
    """Make the `_prepared_pointer` file `latest` (a rename: it needs no space on the disk), durably."""
    os.replace(prepared, root / LATEST_FILE)
    _fsync_dir(root)


def publish(root: Path, tmp: Path, step: int, keep_last: int, latest_back: bool = True) -> Path:
    """Make the complete directory `tmp` checkpoint `step`: rename it, then point `latest` at it (atomically,
    both fsynced), then prune to the newest `keep_last` (call on one rank, after every rank has written).
    `latest_back=False` (the conversion tools) points `latest` at the step only where the directory has no `latest`
    naming another of its checkpoints and no complete checkpoint newer than the step: a step converted into a run's
    own directory would otherwise send its next relaunch back to that step (its saves from there replacing the newer
    checkpoints), or forward onto the converted step and past the checkpoints of a branch the run left, which then
    read as its own (`_set_abandoned_aside`)."""
    final = root / step_dir_name(step)
    newer = None if latest_back else _latest_kept(root, final.name)
    if latest_back:
        _set_abandoned_aside(root, final.name)
    _fsync_dir(tmp)  # the names of its files: without this, `latest` could outlive them in a power loss
    # The new pointer is written before the rename, so that a disk too full for it (or an inode quota) fails the save
    # with nothing published. Written after it, it left `step_N` complete beside a `latest` naming the step before, and
    # the error said "not saved": a relaunch passed the checkpoint over as one left by a run that went back.
    pointer = _prepared_pointer(root, final.name) if newer is None else None
    # The same step saved again (after resuming from an earlier one): its old directory is only set aside here and
    # deleted once the new one has its name. An interruption during that deletion (long, for a large checkpoint)
    # leaves the new checkpoint in place; only the instant between the two renames leaves neither under its name.
    replaced = _set_aside(final) if final.exists() else None
    tmp.rename(final)
    _fsync_dir(root)
    if pointer is not None:
        _replace_pointer(root, pointer)
    else:
        log.warning("%s: %s", final, newer)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    prune(root, final, keep_last)
    return final


ABANDONED_SUFFIX = ".abandoned"  # a checkpoint of a branch a run left by going back (`_set_abandoned_aside`)
ABANDONED = re.compile(r"^step_\d{8}\.abandoned(-\d+)?$")


def _set_abandoned_aside(root: Path, name: str) -> None:
    """Rename the checkpoints between the one `latest` names and checkpoint `name`, about to be published, out of the
    `step_N` names: a run that went back to an earlier step left them. Until now they were newer than `latest`, so
    passed over; once this save moves `latest` past them they would read as this run's own, be resumed by `auto`
    where a newer checkpoint fails to verify (another run's history, silently) and be kept by `keep_last` in place of
    this run's checkpoints (a changed checkpoint.interval saves other steps, which never replace them). Kept, not
    deleted: they are a run's work, and `checkpoint.resume=PATH` still takes them, until `keep_last` of the run's own
    checkpoints are newer (`_prune_abandoned`)."""
    bound = read_pointer(root / LATEST_FILE)
    if not (_STEP_DIR.match(bound) and (root / bound).is_dir() and bound < name):
        return
    for directory in _step_dirs(root):
        if bound < directory.name < name:
            _rename_abandoned(directory, f"a run that went back to an earlier step ({bound}) left it, and this run's "
                                         "checkpoints now pass it")
    _fsync_dir(root)


def _rename_abandoned(directory: Path, why: str) -> None:
    """Rename checkpoint `directory` (`step_N`) `step_N.abandoned` (or `-2`, ...), saying `why`."""
    aside = _unused(directory.with_name(directory.name + ABANDONED_SUFFIX))
    directory.rename(aside)
    log.warning("%s renamed %s: %s; checkpoint.resume=auto never resumes it, and it is deleted once "
                "checkpoint.keep_last of this run's checkpoints are newer (never with keep_last 0); to resume from it, "
                "set checkpoint.resume=%s", directory, aside.name, why, aside)


def point_latest_at(root: Path, resumed: Path) -> list[str]:
    """Point `latest` in `root` at `resumed`, the checkpoint in `root` a launch resumes from (call on rank 0, the
    run's directory locked), where it names another one; returns the names of the complete checkpoints newer than
    `resumed`, which a run going back leaves (then passed over by `auto`, and set aside by the saves that pass
    them). Without this, the first save after going back found `latest` still naming the abandoned branch's newest
    step, and a checkpoint of that branch below the saved step read as the run's own from then on."""
    if resumed.is_file():  # a full checkpoint's state.pt
        resumed = resumed.parent
    if resumed.parent.resolve() != root.resolve():
        return []
    if ABANDONED.match(resumed.name):
        _leave_branch_for(root, resumed)
        return []
    if not _STEP_DIR.match(resumed.name):
        return []
    if read_pointer(root / LATEST_FILE) == resumed.name:
        return []
    _replace_pointer(root, _prepared_pointer(root, resumed.name))
    return [d.name for d in list_checkpoints(root) if d.name > resumed.name]  # (complete ones: resumable)


def _leave_branch_for(root: Path, resumed: Path) -> None:
    """A launch resumes `resumed`, a checkpoint `_set_abandoned_aside` renamed in `root` (`step_N.abandoned`): rename
    the `step_N` directories of its step and newer ones likewise (kept), now. They are of the branch this launch
    leaves, and no `latest` can say so: `latest` names a `step_N` directory, and one of step N or newer passes over
    nothing below it, so such a checkpoint below this launch's first save read as the run's own from then on (kept by
    `keep_last` in place of the run's own, resumed by `auto` where a newer one failed to verify). A `latest` that
    named one of them goes: until this launch saves, `auto` takes the newest complete checkpoint left (older than
    step N)."""
    step = _step_of(resumed)
    left = [d for d in _step_dirs(root) if d.name >= step]
    for directory in left:
        _rename_abandoned(directory, f"this launch resumes {resumed.name}, and leaves the branch that saved it")
    if read_pointer(root / LATEST_FILE) in {d.name for d in left}:
        (root / LATEST_FILE).unlink()
    _fsync_dir(root)


def abandoned_checkpoints(root: Path) -> list[Path]:
    """The checkpoints `_set_abandoned_aside` renamed in `root` (`step_N.abandoned`, `step_N.abandoned-2`, ...)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and ABANDONED.match(p.name))


def _unused(path: Path) -> Path:
    """`path`, or where it exists the first of `path-2`, `path-3`, ... that does not (a step abandoned twice)."""
    candidate, n = path, 2
    while candidate.exists():
        candidate, n = path.with_name(f"{path.name}-{n}"), n + 1
    return candidate


def read_pointer(pointer: Path) -> str:
    """What a `latest` file names ("" where there is none); damaged bytes, even ones that are not text, are read as
    a name no checkpoint has, never an error."""
    return pointer.read_bytes().decode("utf-8", errors="replace").strip() if pointer.is_file() else ""


def _latest_kept(root: Path, name: str) -> Optional[str]:
    """Why a conversion publishing checkpoint `name` in `root` leaves `latest` as it is, or None where it points it at
    `name`. `latest` naming another `step_N` directory there (complete or not: `resume_candidates` bounds by it) is
    the run's choice; where there is none, a complete checkpoint newer than `name` is what `auto` takes."""
    pointer = root / LATEST_FILE
    named = read_pointer(pointer)
    if _STEP_DIR.match(named) and named != name and (root / named).is_dir():
        if named > name:
            return f"{pointer} stays at {named}, newer than this step"
        return (f"{pointer} stays at {named}: a run resuming from {root} passes this newer step over (to resume "
                f"from it, set checkpoint.resume={root / name})")
    newer = [d.name for d in list_checkpoints(root) if d.name > name]
    if newer and named != name:
        return f"{pointer} is not pointed at it: {newer[-1]} is a newer complete checkpoint"
    return None


def prune(root: Path, newest: Path, keep_last: int) -> None:
    """Delete complete checkpoints older than `newest` beyond the newest `keep_last` (`newest` included); never
    `newest` itself, never a newer one; then the set-aside checkpoints as many of them are newer than
    (`_prune_abandoned`). 0 keeps all."""
    if keep_last <= 0:
        return
    older = [p for p in list_checkpoints(root) if p.name < newest.name]
    for old in older[: max(0, len(older) - (keep_last - 1))]:
        _discard(old)
    _prune_abandoned(root, newest, keep_last)


def _prune_abandoned(root: Path, newest: Path, keep_last: int) -> None:
    """Delete each checkpoint set aside from a branch the run left (`step_N.abandoned`) that `keep_last` of the run's
    own complete checkpoints (up to `newest`) are newer than, saying so: `keep_last` would have deleted one of the
    run's own at its step by now. Counted by step, not in with the run's own: a set-aside one never takes the place
    of the run's checkpoints, nor goes before the run has `keep_last` checkpoints past it (one the run was resumed
    from stays while it may still be needed). Before, they were never pruned, and filled the disk of a run that went
    back often."""
    own = [p.name for p in list_checkpoints(root) if p.name <= newest.name]
    for aside in abandoned_checkpoints(root):
        newer = sum(name > _step_of(aside) for name in own)
        if newer >= keep_last:
            _discard(aside)
            log.warning("deleted %s, set aside from a branch the run left: %d of the run's own checkpoints are newer "
                        "(checkpoint.keep_last=%d)", aside, newer, keep_last)


def _step_of(aside: Path) -> str:
    """The `step_N` name a set-aside checkpoint (`step_N.abandoned`, `step_N.abandoned-2`) had."""
    return aside.name[:len(step_dir_name(0))]


def remove_leftovers(root: Path) -> list[str]:
    """Delete what interrupted saves, prunes and pointer updates left in `root` (only while no other writer can
    be active: the run holds its directory's lock); returns their names."""
    if not root.is_dir():
        return []
    found = sorted(p for p in root.iterdir() if _LEFTOVER.match(p.name))
    for path in found:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return [p.name for p in found]


def _step_dirs(root: Path) -> list[Path]:
    """Every `step_N` directory under `root`, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)), key=lambda p: p.name)


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root` (see `checkpoint_problem`), oldest first."""
    return [p for p in _step_dirs(root) if checkpoint_problem(p) is None]


def _legacy_complete(directory: Path) -> bool:
    """A checkpoint written before checksums existed: its state file, or a sharded checkpoint's index and meta.pt."""
    if (directory / STATE_FILE).is_file():
        return True
    return is_sharded_checkpoint(directory) and (directory / META_FILE).is_file()


def not_a_checkpoint(directory: Path) -> Optional[str]:
    """One line when `directory` is a directory of checkpoints (`step_N` directories, `latest`) or a run directory
    holding `checkpoints/`, not a checkpoint itself: it names the newest complete checkpoint in it. None otherwise."""
    if (directory / MANIFEST_FILE).exists() or _legacy_complete(directory):
        return None
    for root in (directory, directory / "checkpoints"):
        steps = _step_dirs(root)
        if steps:
            newest = find_latest(root) or steps[-1]
            return f"{directory} holds checkpoints but is not one: give one of them, e.g. {newest}"
    if (directory / "config.json").is_file() and any(directory.glob("*.safetensors")):
        return (f"{directory} is a Hugging Face model directory, not a megafp8 checkpoint: import it first "
                f"(tools/convert_checkpoint.py from-hf {directory} --out DIR)")
    if directory.is_dir() and not any(p for p in directory.iterdir() if not p.name.startswith(".")):  # a run's
        # `.lock` aside, nothing: not a save cut short (those leave step_N.tmp-* and never a bare directory)
        return f"{directory} holds no checkpoint (a run saves one every checkpoint.interval steps)"
    if directory.is_dir() and not _partly_a_checkpoint(directory):
        return (f"{directory} is not a checkpoint of any format megafp8 knows: it holds no {MANIFEST_FILE} or "
                f"{STATE_FILE} (a full checkpoint), no {INDEX_FILE}, {META_FILE} or *.distcp (a sharded one), no "
                "step_NNNNNNNN directories (a run's checkpoints) and no config.json with *.safetensors (a Hugging Face "
                "model): give a checkpoint's directory, step_NNNNNNNN")
    return None


# A file of either form of checkpoint: a directory that holds one but is no complete checkpoint is one cut short.
_CHECKPOINT_FILES = (MANIFEST_FILE, STATE_FILE, META_FILE, INDEX_FILE, "*.distcp")


def _partly_a_checkpoint(directory: Path) -> bool:
    """Whether `directory` has a checkpoint's name (step_N, or a save's step_N.tmp-*) or any checkpoint file."""
    return (re.match(r"step_\d{8}", directory.name) is not None
            or any(any(directory.glob(pattern)) for pattern in _CHECKPOINT_FILES))


def checkpoint_problem(directory: Path) -> Optional[str]:
    """Why `directory` is not a complete checkpoint, in one line (None if it is): its manifest is missing or
    damaged, or a file it lists is missing or of another size, or it is a directory that holds checkpoints. Cheap:
    no file is read but the manifest (without one, a sharded checkpoint's index)."""
    if not directory.is_dir():
        return f"checkpoint '{directory}' not found"
    try:
        files = read_manifest(directory)
    except ConfigError as err:
        return str(err)
    if files is None:
        if _legacy_complete(directory):
            # No manifest to list its files (written before checksums, or copied without it): a sharded one's index
            # still names its shard files and their sizes, so one that lacks a shard is not taken as complete.
            return short_file_problem(directory) if is_sharded_checkpoint(directory) else None
        return (not_a_checkpoint(directory)
                or f"checkpoint {directory} is incomplete (no {MANIFEST_FILE}: its save did not finish)")
    return quick_problem(directory, files)


def verification_problem(directory: Path, rank: int = 0, world_size: int = 1) -> Optional[str]:
    """Why checkpoint `directory` cannot be trusted, in one line naming the file, or None: its completeness, then
    the checksum of every file (this rank's share of them: each file is read by one of `world_size` ranks).
    A checkpoint written before checksums existed gets the completeness check only."""
    problem = checkpoint_problem(directory)
    if problem is not None:
        return problem
    files = read_manifest(directory)
    return None if files is None else verify_files(directory, share_of(files, rank, world_size))


def verification_problems(directory: Path) -> list[str]:
    """Every reason checkpoint `directory` fails verification, one line each ([] if none). Where it is not a
    checkpoint with an intact manifest (not found, not a checkpoint, incomplete, written before checksums), that
    one reason: nothing in it can be checked. Else every file the manifest lists that is missing, of another size,
    unreadable or failing its checksum (each file read, in this one process)."""
    if directory.is_dir() and has_checksums(directory):
        try:
            files = read_manifest(directory)
        except ConfigError as err:
            return [str(err)]
        return list(file_problems(directory, files))
    return [checkpoint_problem(directory)
            or f"checkpoint {directory} has no {MANIFEST_FILE} (written before megafp8 recorded checksums): its "
               "files cannot be verified"]


def verified_summary(directory: Path, seconds: float) -> str:
    """The line for checkpoint `directory` once every file of it matched its checksum, in `seconds`."""
    files = read_manifest(directory) or {}
    size = sum(r.size for r in files.values())
    return f"{directory}: {len(files)} files, {size / 2**30:.3f} GiB, every checksum matches ({seconds:.1f} s)"


def verify_checkpoint(directory: Path) -> str:
    """Check every file of checkpoint `directory` against the checksum recorded when it was written, in this one
    process (nothing is loaded); a summary line, or a ConfigError naming the first problem
    (`verification_problems` lists them all)."""
    started = time.perf_counter()
    problems = verification_problems(directory)
    if problems:
        raise ConfigError(problems[0])
    return verified_summary(directory, time.perf_counter() - started)


def has_checksums(directory: Path) -> bool:
    return (directory / MANIFEST_FILE).is_file()


def checkpoint_bytes(directory: Path) -> int:
    """Bytes of the files a checkpoint's manifest lists (0 without one)."""
    files = read_manifest(directory) or {}
    return sum(r.size for r in files.values())


def find_latest(root: Path) -> Optional[Path]:
    """The complete checkpoint `latest` names, else the newest complete one (None if there is none)."""
    candidates, _ = resume_candidates(root)
    return candidates[0] if candidates else None


def resume_candidates(root: Path) -> tuple[list[Path], list[str]]:
    """The complete checkpoints to resume from, best first: the one `latest` names, then older ones, newest first
    (checkpoints newer than `latest` belong to a run that went back to an earlier step, and are passed over);
    and one line for each `step_N` directory passed over: incomplete, or (last) complete but newer than `latest`.
    A `latest` that names no checkpoint (damaged, not even text) is ignored: the newest complete one is first."""
    pointer = root / LATEST_FILE
    named = read_pointer(pointer)
    bound = named if _STEP_DIR.match(named) and (root / named).is_dir() else None
    candidates, skipped, newer = [], [], []
    for directory in reversed(_step_dirs(root)):
        problem = checkpoint_problem(directory)
        if bound is not None and directory.name > bound:
            if problem is None:  # said, since this run's saves of those steps will replace them
                newer.append(f"{directory} is complete but newer than {bound}, which {pointer} names (a run that "
                             "went back to an earlier step left it); to resume from it, set "
                             f"checkpoint.resume={directory}")
            continue
        if problem is None:
            candidates.append(directory)
        else:
            skipped.append(problem)
    return candidates, skipped + newer


def saved_config(directory: Path) -> Optional[dict[str, Any]]:
    """The run config recorded in checkpoint `directory`, without reading its tensors (a full checkpoint's state file
    is memory-mapped); None where it records none or its file cannot be read (verification names a damaged file)."""
    file = directory / (META_FILE if is_sharded_checkpoint(directory) else STATE_FILE)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # torch raises several types for truncated or foreign files
        return None
    config = state.get("config") if isinstance(state, dict) else None
    return config if isinstance(config, dict) else None
