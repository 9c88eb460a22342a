"""One run directory holds one run: what an earlier launch left in it, and whether this launch may continue it.

A launch whose config matches the earlier run's (`config.yaml`), apart from the settings that may change between
launches of one run (`RELAUNCH_SETTINGS`: how long, where and how it runs, what it logs), continues that run:
`checkpoint.resume=auto` resumes its newest checkpoint (what a SLURM requeue needs), or starts it over from step 0
where it saved none. Metric records after the step a launch starts from are dropped, so a curve is never spliced.
Another config, `checkpoint.resume=none` over the run's checkpoints, or a `checkpoint.dir` moved away from the one
that still holds them, is refused in one line unless `checkpoint.overwrite` says to replace the earlier run.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from megafp8.checkpoint.local import LATEST_FILE, abandoned_checkpoints, list_checkpoints, point_latest_at
from megafp8.config import CheckpointConfig, Config, ConfigError
from megafp8.config.loader import build_dataclass, config_to_dict, flat_settings
from megafp8.config.schema import upgrade_saved_model
from megafp8.parallel import ParallelDims
from megafp8.train.resume import from_rank0, verified_resume_path

log = logging.getLogger("megafp8")
CONFIG_FILE = "config.yaml"
RUN_INFO_FILE = "run_info.json"
# Settings (dotted prefixes) that may differ between launches of one run. The optimizer's bucket size and overlap
# only group and schedule the same per-element reductions; `training.deterministic` fixes the order of sums that
# otherwise varies run to run.
RELAUNCH_SETTINGS = ("training.steps", "training.device", "training.compile", "training.recompute",
                     "training.deterministic",
                     "training.eval_interval", "training.eval_iters", "training.micro_batch_size", "parallel.",
                     "checkpoint.", "logging.", "precision.fp8_backend", "optimizer.bucket_size_mb",
                     "optimizer.overlap_grad_reduce")
# What a run writes into its run directory besides the checkpoints and the metrics file (removed on overwrite).
_RUN_FILES = (CONFIG_FILE, RUN_INFO_FILE, "tensorboard", "wandb")


@dataclass(frozen=True)
class EarlierRun:
    """What an earlier launch left: its config (None if it left no config.yaml), metrics and checkpoints, and,
    where this launch's checkpoint directory holds none, the earlier launch's other one with its newest checkpoint
    (`left_behind`)."""

    config: Optional[dict[str, Any]]
    has_metrics: bool
    checkpoints: list[str]
    left_behind: Optional[tuple[Path, str]] = None
    vanished: Optional[tuple[int, int]] = None  # (last step logged, save interval) where the checkpoint dir is gone


@dataclass(frozen=True)
class Verdict:
    """How this launch treats the run directory: `refusal` (one line) or `replace` the earlier run."""

    refusal: Optional[str] = None
    replace: bool = False


def run_paths(cfg: Config) -> tuple[Path, Path, Path]:
    """Where a run's files go: (run directory, checkpoint directory, metrics file)."""
    run_dir = Path(cfg.logging.output_dir) / (cfg.run_name or "run")
    metrics_path = Path(cfg.logging.metrics_file)
    return (run_dir, checkpoint_dir_of(run_dir, cfg.checkpoint.dir),
            metrics_path if metrics_path.is_absolute() else run_dir / metrics_path)


def checkpoint_dir_of(run_dir: Path, setting: Optional[str]) -> Path:
    """The checkpoint directory that `checkpoint.dir` = `setting` names for the run in `run_dir` (a relative one is
    relative to the working directory, as the run's own paths are)."""
    return Path(setting) if setting else run_dir / "checkpoints"


def choose_start(run_dir: Path, checkpoint_dir: Path, metrics_path: Path, config: dict[str, Any],
                 checkpoint: CheckpointConfig, dims: ParallelDims) -> tuple[bool, Optional[Path]]:
    """Judge what an earlier launch left in the run directory (a ConfigError refuses this launch on every rank),
    then find the verified checkpoint to resume from, if any (collective). Returns (whether the earlier run is to
    be replaced, that checkpoint). Writes nothing."""
    verdict = from_rank0(lambda: judge(read_earlier_run(run_dir, checkpoint_dir, metrics_path), config,
                                       checkpoint.resume, checkpoint.overwrite, run_dir, checkpoint_dir), dims)
    if verdict.refusal is not None:
        raise ConfigError(verdict.refusal)
    resume = "none" if verdict.replace else checkpoint.resume
    return verdict.replace, verified_resume_path(resume, checkpoint_dir, dims)


def record_launch(run_dir: Path, checkpoint_dir: Path, metrics_path: Path, step: int, replace: bool,
                  resumed_from: Optional[Path], config_yaml: str, named: bool = False) -> None:
    """On rank 0 (the run validated and its directories locked): remove a replaced run, drop the metric records
    after `step`, where this launch starts, and record the config. Says in one line what became of an earlier
    launch. `named`: `resumed_from` is the checkpoint `checkpoint.resume` names; where it is in `checkpoint_dir`, the
    run goes back to it, and `latest` is pointed at it (`point_latest_at`). Not where `auto` took it (passing over
    newer ones that failed to verify, perhaps for a reason gone by the next launch: a read gone wrong on one node):
    the next launch tries those again."""
    relaunch = (run_dir / CONFIG_FILE).is_file() or metrics_path.is_file()
    if replace:
        remove_earlier_run(run_dir, checkpoint_dir, metrics_path)
        log.info("checkpoint.overwrite: replaced the earlier run in %s", run_dir)
    dropped = drop_metrics_after(metrics_path, step)
    dropped_note = (f"; dropped {dropped} metric record(s) after step {step} (kept in "
                    f"{dropped_metrics_path(metrics_path).name})" if dropped else "")
    if resumed_from is not None:
        log.info("resuming %s from step %d (%s)%s", run_dir, step, resumed_from, dropped_note)
        newer = point_latest_at(checkpoint_dir, resumed_from) if named else []
        if newer:
            log.warning("going back to %s: %s now names it, so checkpoint.resume=auto resumes it too; the newer "
                        "checkpoint(s) %s are passed over, and each is renamed step_N.abandoned once this run's saves "
                        "pass its step (kept until checkpoint.keep_last of this run's checkpoints are newer; to go on "
                        "from the newest instead, relaunch with checkpoint.resume=%s)",
                        resumed_from.name, checkpoint_dir / LATEST_FILE, ", ".join(newer), checkpoint_dir / newer[-1])
    elif relaunch and not replace:
        log.info("%s holds an earlier launch of this run without a checkpoint: starting it over from step 0%s",
                 run_dir, dropped_note)
    run_dir.mkdir(parents=True, exist_ok=True)
    replace_file(run_dir / CONFIG_FILE, config_yaml)


def read_earlier_run(run_dir: Path, checkpoint_dir: Path, metrics_path: Path) -> Optional[EarlierRun]:
    """What an earlier launch left in `run_dir` (and `checkpoint_dir`, `metrics_path`); None if nothing."""
    config_file = run_dir / CONFIG_FILE
    config = yaml.safe_load(config_file.read_text()) if config_file.is_file() else None
    checkpoints = [p.name for p in list_checkpoints(checkpoint_dir)]
    has_metrics = metrics_path.is_file() and metrics_path.stat().st_size > 0
    if config is None and not checkpoints and not has_metrics:
        return None
    if not isinstance(config, dict):
        return EarlierRun(None, has_metrics, checkpoints)
    if isinstance(config.get("model"), dict):  # an earlier version's layout: today's
        config = {**config, "model": upgrade_saved_model(config["model"])}
    left_behind = None if checkpoints else checkpoints_left_behind(config, run_dir, checkpoint_dir)
    vanished = None if checkpoints or left_behind else _checkpoints_vanished(config, checkpoint_dir, metrics_path)
    return EarlierRun(config, has_metrics, checkpoints, left_behind, vanished)


def _checkpoints_vanished(config: dict[str, Any], checkpoint_dir: Path, metrics_path: Path
                          ) -> Optional[tuple[int, int]]:
    """(the last step the earlier launch logged, its checkpoint interval) where it logged a step it saved a checkpoint
    at, yet its checkpoint directory no longer exists or holds nothing at all, not even the lock file every launch
    leaves there (a file system not mounted over an empty mount point, a directory moved or deleted): `auto` would
    start the run over from step 0 and drop its metrics. None otherwise (a run whose saves failed leaves the
    directory and its lock file, and a run over from step 0 is then all there is to do)."""
    saved = config.get("checkpoint")
    interval = saved.get("interval") if isinstance(saved, dict) else None
    if not isinstance(interval, int) or interval <= 0 or not metrics_path.is_file():
        return None
    if checkpoint_dir.is_dir() and any(checkpoint_dir.iterdir()):
        return None
    steps = [_step_of(line) for line in metrics_path.read_text(encoding="utf-8").splitlines() if line.strip()]
    last = max((step for step in steps if step < 2**62), default=-1)
    return (last, interval) if last >= interval else None


def checkpoints_left_behind(config: dict[str, Any], run_dir: Path, checkpoint_dir: Path) -> Optional[tuple[Path, str]]:
    """The checkpoint directory the earlier launch (its `config`) saved in and its newest checkpoint, where that is
    another directory than this launch's `checkpoint_dir` and still holds checkpoints; None otherwise."""
    saved = config.get("checkpoint")
    if not isinstance(saved, dict):
        return None
    earlier_dir = checkpoint_dir_of(run_dir, saved.get("dir"))
    if earlier_dir.resolve() == checkpoint_dir.resolve():
        return None
    found = list_checkpoints(earlier_dir)
    return (earlier_dir, found[-1].name) if found else None


def config_changes(saved: dict[str, Any], current: dict[str, Any], shared_only: bool = False) -> list[str]:
    """`key: <saved> there, <current> here` for each setting that makes `current` another run than `saved`. A
    setting `saved` lacks (written before the setting existed) counts as its default, the behaviour of the version
    that wrote it. `shared_only`: only the settings both hold (a checkpoint's config from another version)."""
    old, new = flat_settings(saved), flat_settings(current)
    defaults = _defaults_like(current)
    old.update({k: defaults[k] for k in new if k not in old and k in defaults})
    unread = {"data.path"} if old.get("data.paths") and new.get("data.paths") else set()  # a mixture's runs
    keys = [k for k in dict.fromkeys([*new, *old]) if not k.startswith(RELAUNCH_SETTINGS) and k not in unread
            and (not shared_only or (k in old and k in new))]
    return [f"{k}: {old.get(k)} there, {new.get(k)} here" for k in keys if old.get(k) != new.get(k)]


def _defaults_like(current: dict[str, Any]) -> dict[str, Any]:
    """Every setting's default, flat, for the kinds `current` chose (`model.attention.kind`): a section's settings
    depend on its kind."""
    skeleton: dict[str, Any] = {}
    for key, kind in flat_settings(current).items():
        if key.endswith(".kind"):
            *sections, leaf = key.split(".")
            node = skeleton
            for section in sections:
                node = node.setdefault(section, {})
            node[leaf] = kind
    try:
        return flat_settings(config_to_dict(build_dataclass(Config, skeleton)))
    except ConfigError:  # a kind this version does not know: no defaults, every missing setting differs
        return {}


def judge(earlier: Optional[EarlierRun], current: dict[str, Any], resume: str, overwrite: bool, run_dir: Path,
          checkpoint_dir: Path) -> Verdict:
    """Whether this launch (resolved config `current`) may use `run_dir`, given what an earlier launch left."""
    if earlier is None:
        return Verdict()
    changes = config_changes(earlier.config, current) if earlier.config is not None else []
    if changes:
        if overwrite:
            return Verdict(replace=True)
        more = f" and {len(changes) - 1} more setting(s)" if len(changes) > 1 else ""
        return Verdict(refusal=f"{run_dir} holds another run ({changes[0]}{more}): give this run another run_name"
                               f"{_start_from(earlier, changes, checkpoint_dir, resume)}, or set checkpoint.overwrite=true "
                               "to replace that run")
    if resume == "none" and earlier.checkpoints:
        if overwrite:
            return Verdict(replace=True)
        return Verdict(refusal=f"checkpoint.resume=none, but {checkpoint_dir} holds this run's checkpoints (newest "
                               f"{earlier.checkpoints[-1]}): leave checkpoint.resume=auto to continue it, give this "
                               "run another run_name, or set checkpoint.overwrite=true to start it over")
    if earlier.left_behind is not None and resume in ("auto", "none"):  # `auto` would start over from step 0
        if overwrite:
            return Verdict(replace=True)  # the checkpoints left behind stay where they are
        earlier_dir, newest = earlier.left_behind
        return Verdict(refusal=f"checkpoint.dir is {checkpoint_dir}, which holds no checkpoint, but this run's earlier "
                               f"launch saved them in {earlier_dir} (newest {newest}): set checkpoint.dir back to it "
                               f"or move its checkpoints into {checkpoint_dir} to continue the run, or name one "
                               "(checkpoint.resume=PATH); give this run another run_name, or set "
                               "checkpoint.overwrite=true to start it over")
    if earlier.vanished is not None and resume in ("auto", "none"):
        if overwrite:
            return Verdict(replace=True)
        last, interval = earlier.vanished
        return Verdict(refusal=f"the earlier launch of this run logged up to step {last}, saving a checkpoint every "
                               f"{interval} steps, but its checkpoint directory {checkpoint_dir} is gone or empty "
                               "(a file system not mounted, or the directory moved or deleted?): bring it back to "
                               "continue the run, name a checkpoint (checkpoint.resume=PATH), give this run another "
                               "run_name, or set checkpoint.overwrite=true to start it over from step 0")
    return Verdict()


def _start_from(earlier: EarlierRun, changes: list[str], checkpoint_dir: Path, resume: str) -> str:
    """How a new run starts from the earlier run's newest checkpoint, as a clause of the refusal; empty where there
    is none, where the model changed (its tensors would not fit), or where this launch names a checkpoint already
    (`resume`: it only needs its own run_name)."""
    named = resume not in ("auto", "none")
    if named or not earlier.checkpoints or any(change.startswith("model.") for change in changes):
        return ""
    newest = checkpoint_dir / earlier.checkpoints[-1]
    return f" (to continue from that run's newest checkpoint: checkpoint.resume={newest})"


def remove_earlier_run(run_dir: Path, checkpoint_dir: Path, metrics_path: Path) -> None:
    """Delete an earlier run's checkpoints, metrics and run files (`checkpoint.overwrite`); nothing else."""
    for path in list_checkpoints(checkpoint_dir) + abandoned_checkpoints(checkpoint_dir) + \
            [checkpoint_dir / LATEST_FILE, metrics_path, dropped_metrics_path(metrics_path)] + \
            [run_dir / name for name in _RUN_FILES]:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def dropped_metrics_path(metrics_path: Path) -> Path:
    """Where `drop_metrics_after` keeps the records it takes out of `metrics_path` (metrics.dropped.jsonl)."""
    return metrics_path.with_name(f"{metrics_path.stem}.dropped{metrics_path.suffix}")


def drop_metrics_after(metrics_path: Path, step: int) -> int:
    """Move the records after `step` out of the metrics file (records without a step stay), appending them to
    `dropped_metrics_path`: a relaunch re-logs those steps, and the metrics file stays one history, yet the records
    can be what a run that went back to an earlier step went back from (a loss spike). Returns how many."""
    if not metrics_path.is_file():
        return 0
    lines = metrics_path.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if line.strip() and _step_of(line) <= step]
    dropped = len(lines) - len(kept)
    if dropped:
        taken = [line for line in lines if line.strip() and _step_of(line) > step]
        kept_aside = dropped_metrics_path(metrics_path)
        if not _ends_with(kept_aside, taken):  # else a kill came between the two: they were kept aside already
            with open(kept_aside, "a", encoding="utf-8") as f:  # before the rewrite: a kill between the two
                f.write("\n" * _cut_short(kept_aside) + "".join(line + "\n" for line in taken))  # leaves them in both
                f.flush()
                os.fsync(f.fileno())
        replace_file(metrics_path, "".join(line + "\n" for line in kept))
    return dropped


def _ends_with(path: Path, lines: list[str]) -> bool:
    """Whether the file at `path` ends with `lines`: the records an earlier drop appended before it was killed, ahead
    of the metrics file's rewrite (the relaunch after finds them in both, and would keep them aside twice)."""
    if not path.is_file():
        return False
    held = path.read_text(encoding="utf-8").splitlines()
    return len(held) >= len(lines) and held[len(held) - len(lines):] == lines


def _cut_short(path: Path) -> bool:
    """Whether `path` ends in a line without its newline (an append killed midway): ended before the next append,
    whose first record would join it."""
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def replace_file(path: Path, text: str) -> None:
    """Replace `path` by a file holding `text`, atomically: a write cut short (a full disk, a kill) leaves the
    earlier file whole, never a truncated one (config.yaml is how a relaunch knows its run)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _step_of(line: str) -> int:
    try:
        step = json.loads(line).get("step")
    except (json.JSONDecodeError, AttributeError):
        return 2**62  # an unreadable line is dropped
    return int(step) if isinstance(step, (int, float)) else -1
