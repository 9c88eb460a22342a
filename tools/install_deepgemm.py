#!/usr/bin/env python
"""Build DeepSeek's DeepGEMM for the `deepgemm` FP8 backend (what `precision.fp8_backend: auto` picks where it
runs), check it on this GPU, and write the environment a run needs to use it.

    python tools/install_deepgemm.py --prefix ~/deepgemm                  # clones DeepGEMM at the measured commit
    python tools/install_deepgemm.py --prefix ~/deepgemm --source DIR     # a clone with its submodules (no network)
    source ~/deepgemm/deepgemm.env                                         # then auto picks deepgemm

DeepGEMM (github.com/deepseek-ai/DeepGEMM) is built from source against the installed torch with the CUDA toolkit's
nvcc, which it also needs at run time (it JIT-compiles each GEMM shape at first use). Built as it comes, its first
JIT call crashed the process on the H200 machine we measured on (its `std::regex` reached a locale facet of the
system's libstdc++, which torch's process had loaded, not the compiler's: docs/benchmarks.md, jobs GS-GT). So this
makes two builds side by side, as it comes and with libstdc++ linked statically, and runs the backend's own check
(`deepgemm_backend.smoke_test`, in a child process, against the FP32 product) on three candidates in turn: as it
comes, static, and as it comes with the compiler's libstdc++ preloaded. The first that passes is written into
PREFIX/deepgemm.env (PYTHONPATH, and LD_PRELOAD where it needs it); source that file before `torchrun` (or in the
SLURM script). Building needs no GPU (`--build-only`, e.g. on a login node); checking does, and reuses the builds.
Running it again after a successful install only says so (`--recheck` checks again, `--rebuild` builds again).
`--export-builds FILE` writes the built extensions to an archive that `--prebuilt FILE` places on another machine
with the same torch, CUDA and source instead of compiling (a few minutes saved; they are checked as any build).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import zlib
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.config.arguments import run_tool  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
DEEPGEMM_URL = "https://github.com/deepseek-ai/DeepGEMM"
DEEPGEMM_COMMIT = "54e2261"  # 2.6.1: the build measured in docs/benchmarks.md (jobs GS-GZ)
VARIANTS = ("plain", "static")
ENV_FILE = "deepgemm.env"
STAMP = ".megafp8_build"  # in each build: where its source came from, so a changed source is rebuilt
BUILD_TIMEOUT_S = 1800
DEFAULT_CUDA_HOME = Path("/usr/local/cuda")  # where the toolkit is when neither CUDA_HOME nor PATH names it


class InstallError(RuntimeError):
    """A step that cannot go on, with what to change."""


@dataclasses.dataclass(frozen=True)
class Toolchain:
    cuda_home: Path
    cxx: str


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run DeepGEMM: a build (`variant`, in `path`) and the library to preload for it, if any."""
    variant: str
    path: Path
    preload: Optional[str] = None

    def describe(self) -> str:
        return self.variant + (f", with {self.preload} preloaded" if self.preload else "")

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """`base` with this build (and megafp8, for the check) first on PYTHONPATH and its preload, if any."""
        env = dict(base)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.path), str(REPO_ROOT), base.get("PYTHONPATH")) if p)
        if self.preload:
            env["LD_PRELOAD"] = " ".join(p for p in (self.preload, base.get("LD_PRELOAD")) if p)
        return env


def check_source(source: Path) -> Path:
    """`source` if it is a DeepGEMM tree with the submodules' headers its build reads, else an error saying what is
    missing."""
    source = source.expanduser().resolve()
    if not source.is_dir():
        raise InstallError(f"{source} does not exist: pass a clone of {DEEPGEMM_URL} made with --recursive, or "
                           "leave --source out to clone it here")
    needs = {"setup.py": "DeepGEMM's setup.py", "deep_gemm/__init__.py": "the deep_gemm package",
             "csrc": "its C++ sources", "third-party/cutlass/include/cute": "the cutlass submodule's headers",
             "third-party/fmt/include": "the fmt submodule's headers"}
    missing = [f"{what} ({rel})" for rel, what in needs.items() if not (source / rel).exists()]
    if missing:
        hint = ("clone it with `git clone --recursive`, or run `git submodule update --init` in it"
                if any("submodule" in m for m in missing) and (source / "setup.py").exists()
                else f"pass a clone of {DEEPGEMM_URL} (with --recursive)")
        raise InstallError(f"{source} is not a DeepGEMM source tree: it lacks {', '.join(missing)}; {hint}")
    return source


def clone(dest: Path, commit: str, run: Callable = subprocess.run) -> Path:
    """A recursive clone of DeepGEMM at `commit` in `dest`: reused where it is one at that commit, else made again,
    in a temporary directory renamed into place only once every step has passed (a failed checkout leaves nothing
    that a later run would take for a clone at `commit`)."""
    if (dest / "setup.py").exists() and _head(dest, run) == _head(dest, run, commit):
        return check_source(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    for stale in (tmp, dest):
        if stale.exists():
            shutil.rmtree(stale)
    steps = [["git", "clone", "-q", DEEPGEMM_URL, str(tmp)],
             ["git", "-C", str(tmp), "checkout", "-q", commit],
             ["git", "-C", str(tmp), "submodule", "update", "-q", "--init", "--recursive"]]
    for step in steps:
        done = run(step, capture_output=True, text=True)
        if done.returncode != 0:
            raise InstallError(f"`{' '.join(step)}` failed ({done.stderr.strip()[-300:]}); without network, "
                               "clone DeepGEMM recursively elsewhere and pass it with --source")
    tmp.rename(dest)
    return check_source(dest)


def _head(clone_dir: Path, run: Callable, revision: str = "HEAD") -> Optional[str]:
    """The commit `revision` names in the clone, or None where it names none there."""
    done = run(["git", "-C", str(clone_dir), "rev-parse", "-q", "--verify", f"{revision}^{{commit}}"],
               capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def find_toolchain(env: dict[str, str]) -> Toolchain:
    """The CUDA toolkit (CUDA_HOME, else nvcc's) and the C++ compiler (CXX, else c++ or g++)."""
    cuda_home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if not cuda_home:
        nvcc = shutil.which("nvcc", path=env.get("PATH"))
        cuda_home = str(Path(nvcc).resolve().parents[1]) if nvcc else str(DEFAULT_CUDA_HOME)
    if not cuda_home or not (Path(cuda_home) / "bin" / "nvcc").exists():
        raise InstallError("DeepGEMM's build and its JIT need the CUDA toolkit's nvcc: set CUDA_HOME to the toolkit "
                           f"(looked in {cuda_home}) or put nvcc on PATH")
    cxx = env.get("CXX") or shutil.which("c++", path=env.get("PATH")) or shutil.which("g++", path=env.get("PATH"))
    if not cxx:
        raise InstallError("no C++ compiler found: set CXX or install g++")
    return Toolchain(Path(cuda_home), cxx)


def build_env(toolchain: Toolchain, variant: str, base: dict[str, str]) -> dict[str, str]:
    env = {**base, "CUDA_HOME": str(toolchain.cuda_home),  # (CXX as the caller set it: setuptools' choice otherwise)
           "PATH": os.pathsep.join((str(toolchain.cuda_home / "bin"), base.get("PATH", "")))}
    if variant == "static":  # no libstdc++ of its own to load at run time: whichever the process has cannot clash
        env["LDFLAGS"] = " ".join(p for p in (base.get("LDFLAGS"), "-static-libstdc++ -static-libgcc") if p)
    return env


def source_id(source: Path) -> str:
    """What a build records of its source: the path, and the commit where it is a clone of its own (a clone moved
    to another commit is built again; a tree unpacked inside another repository has no commit of its own)."""
    git = subprocess.run(["git", "-C", str(source), "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                         text=True)
    lines = git.stdout.split()
    own = git.returncode == 0 and len(lines) == 2 and Path(lines[0]).resolve() == source.resolve()
    return f"{source}\n{lines[1] if own else ''}"


def is_built(dest: Path, source: Path) -> bool:
    stamp = dest / STAMP
    return stamp.exists() and stamp.read_text() == source_id(source) and any((dest / "deep_gemm").glob("_C*.so"))


def _copy_source(source: Path, dest: Path) -> None:
    """`source` copied to `dest` (no build outputs), cutlass's headers linked where DeepGEMM's JIT reads them."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(source, dest, symlinks=True, ignore=shutil.ignore_patterns(".git", "build", "*.so"))
    include = dest / "deep_gemm" / "include"
    for name in ("cutlass", "cute"):
        link = include / name
        if link.is_symlink() or link.exists():
            link.unlink() if link.is_symlink() else shutil.rmtree(link)
        link.symlink_to(dest / "third-party" / "cutlass" / "include" / name)


def start_build(source: Path, dest: Path, variant: str, toolchain: Toolchain, log: Path,
                base: dict[str, str]) -> subprocess.Popen:
    """Copy `source` to `dest` and start DeepGEMM's in-place build there (its develop.sh, as a process): the
    extension built by `setup.py build`, linked into the package."""
    _copy_source(source, dest)
    script = ('set -e; "$PYTHON" setup.py build; so=$(find build -name "_C*.so" | head -n 1); '
              '[ -n "$so" ] || { echo "setup.py build made no _C*.so" >&2; exit 1; }; ln -sf "$PWD/$so" deep_gemm/')
    env = {**build_env(toolchain, variant, base), "PYTHON": sys.executable}  # built against this torch
    with log.open("w") as out:
        return subprocess.Popen(["bash", "-c", script], cwd=dest, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group: a timeout stops the compilers too


def build_all(source: Path, prefix: Path, toolchain: Toolchain, rebuild: bool, base: dict[str, str],
              say: Callable[[str], None] = print) -> None:
    """Both builds, side by side (a few minutes; reused when already built from the same source)."""
    started = {}
    for variant in VARIANTS:
        dest = prefix / variant
        if not rebuild and is_built(dest, source):
            say(f"{variant}: built before, in {dest}")
            continue
        say(f"{variant}: building in {dest} (log {prefix / f'build_{variant}.log'})")
        started[variant] = start_build(source, dest, variant, toolchain, prefix / f"build_{variant}.log", base)
    failed = []
    deadline = time.monotonic() + BUILD_TIMEOUT_S  # one bound for both: they run side by side
    try:
        for variant, process in started.items():
            try:
                rc = process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = f"timeout after {BUILD_TIMEOUT_S} s"
            if rc != 0:
                failed.append(f"{variant} (rc {rc}; {_tail(prefix / f'build_{variant}.log')})")
            else:
                (prefix / variant / STAMP).write_text(source_id(source))
    finally:  # a timeout, Ctrl-C or an error here: no compiler is left running (they are in their own sessions)
        for process in started.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    if len(failed) == len(VARIANTS):
        raise InstallError(f"no DeepGEMM build succeeded: {'; '.join(failed)}")
    for what in failed:
        say(f"build failed, skipped: {what}")


def export_builds(prefix: Path, source: Path, archive: Path) -> list[str]:
    """The built extensions (`VARIANT/_C*.so`, the links followed) written to the tar archive `archive`, for
    `--prebuilt` on another machine with the same torch, CUDA and source; returns the variants written."""
    written = []
    with tarfile.open(archive, "w:gz") as tar:
        for variant in VARIANTS:
            if is_built(prefix / variant, source):
                for so in (prefix / variant / "deep_gemm").glob("_C*.so"):
                    tar.add(so.resolve(), arcname=f"{variant}/{so.name}")
                written.append(variant)
    return written


def place_prebuilt(archive: Path, source: Path, prefix: Path, say: Callable[[str], None] = print) -> list[str]:
    """Each variant of the archive written by `export_builds` that is not built here placed as built: `source`
    copied, the archive's extension linked into its package, stamped with `source` (last: a variant cut short is
    not taken for built). The check that follows decides whether it runs here (a build for another torch fails it:
    build again with --rebuild). Returns those placed."""
    placed = []
    try:
        with tarfile.open(archive, "r:*") as tar:
            members = {m.name: m for m in tar.getmembers() if m.isfile()}
            for variant in VARIANTS:
                names = [n for n in members if n.startswith(f"{variant}/_C") and n.endswith(".so")
                         and n.count("/") == 1]
                dest = prefix / variant
                if not names or is_built(dest, source):
                    continue
                _copy_source(source, dest)
                target = dest / "build" / "prebuilt"
                target.mkdir(parents=True)
                so = target / Path(names[0]).name
                with tar.extractfile(members[names[0]]) as data, so.open("wb") as out:
                    shutil.copyfileobj(data, out)
                (dest / "deep_gemm" / so.name).symlink_to(so)
                (dest / STAMP).write_text(source_id(source))
                placed.append(variant)
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise InstallError(f"--prebuilt {archive} is not a readable archive ({exc}): pass one written by "
                           "--export-builds, or leave --prebuilt out to build") from exc
    say(f"prebuilt from {archive}: {', '.join(placed) or 'nothing placed (already built, or none in it)'}")
    return placed


def candidates(prefix: Path, source: Path, cxx: str) -> list[Candidate]:
    """The built forms, least intrusive first: as it comes, static, then as it comes with the compiler's libstdc++
    preloaded (the cure measured on the H200 machine; preloading affects the whole training process)."""
    plain_built, static = is_built(prefix / "plain", source), prefix / "static"
    found = [Candidate("plain", prefix / "plain")] if plain_built else []
    if is_built(static, source):
        found.append(Candidate("static", static))
    if plain_built:
        libstdcxx = subprocess.run([cxx, "-print-file-name=libstdc++.so.6"], capture_output=True,
                                   text=True).stdout.strip()
        if libstdcxx and Path(libstdcxx).is_absolute() and Path(libstdcxx).exists():
            found.append(Candidate("plain", prefix / "plain", preload=libstdcxx))
    return found


def check(candidate: Candidate, device_index: int, base: dict[str, str], timeout_s: float) -> Optional[str]:
    """None if the deepgemm backend's own check passes with `candidate` in a child process, else why not."""
    from megafp8.precision.backends.deepgemm_backend import smoke_test_failure
    return smoke_test_failure(device_index, env=candidate.env(base), timeout_s=timeout_s)


def write_env(prefix: Path, chosen: Candidate, checked_on: str, version: str, source: Path, cuda_home: Path) -> Path:
    """PREFIX/deepgemm.env: what a run sources to use `chosen` (it keeps what PYTHONPATH, PATH and LD_PRELOAD held),
    with the CUDA toolkit the check ran with (DeepGEMM's JIT calls its nvcc at run time)."""
    lines = [f"# Made by megafp8's tools/install_deepgemm.py on {datetime.date.today()}: DeepGEMM {version}, "
             f"build '{chosen.describe()}', checked on {checked_on}.",
             "# Source it before torchrun (or in the SLURM script), then set precision.fp8_backend=deepgemm.",
             f"# build: {chosen.path}",
             f"# source: {_one_line(source_id(source))}",
             f'export CUDA_HOME="{cuda_home}"',
             f'export PATH="{cuda_home / "bin"}:$PATH"',
             f'export PYTHONPATH="{chosen.path}${{PYTHONPATH:+:$PYTHONPATH}}"']
    if chosen.preload:
        lines.append(f'export LD_PRELOAD="{chosen.preload}${{LD_PRELOAD:+ $LD_PRELOAD}}"')
    path = prefix / ENV_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    return path


def _one_line(text: str) -> str:
    return " @ ".join(text.splitlines())


def installed_build(env_file: Path, source: Path) -> Optional[Path]:
    """The build that `env_file` (written by `write_env`) points at, where it was checked as built from `source` as
    it is now; None where there is no such file or it records another source."""
    if not env_file.exists():
        return None
    fields = dict(line[2:].split(": ", 1) for line in env_file.read_text().splitlines()
                  if line.startswith(("# build: ", "# source: ")))
    if fields.get("source") != _one_line(source_id(source)) or "build" not in fields:
        return None
    return Path(fields["build"])


def deepgemm_version(build: Path) -> str:
    for line in (build / "deep_gemm" / "__init__.py").read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("'\"")
    return "(unknown version)"


def gpu_name(device_index: int) -> Optional[str]:
    """This GPU's name, or None where there is no CUDA GPU to check on."""
    import torch
    if not torch.cuda.is_available() or device_index >= torch.cuda.device_count():
        return None
    return torch.cuda.get_device_name(device_index)


def install(args: argparse.Namespace, base: dict[str, str], say: Callable[[str], None] = print) -> int:
    prefix = args.prefix.expanduser().resolve()
    prefix.mkdir(parents=True, exist_ok=True)
    source = check_source(args.source) if args.source else clone(prefix / "src", args.commit)
    env_file = prefix / ENV_FILE
    build = installed_build(env_file, source)
    if build is not None and is_built(build, source) and not (args.recheck or args.rebuild or args.build_only):
        say(f"already installed and checked: {env_file.read_text().splitlines()[0].lstrip('# ')}\n"
            f"source {env_file}   (--recheck to check it again, --rebuild to build again)")
        _export_if_asked(args, prefix, source, say)
        return 0
    toolchain = find_toolchain(base)
    if args.prebuilt and not args.rebuild:
        if not args.prebuilt.is_file():
            raise InstallError(f"--prebuilt {args.prebuilt}: no such file (an archive written by --export-builds)")
        place_prebuilt(args.prebuilt, source, prefix, say)
    if args.rebuild or not all(is_built(prefix / v, source) for v in VARIANTS):
        env_file.unlink(missing_ok=True)  # it vouches for the builds it was checked with, not for new ones
    t0 = time.monotonic()
    build_all(source, prefix, toolchain, args.rebuild, base, say)
    say(f"built in {time.monotonic() - t0:.0f} s")
    if args.build_only:
        say(f"not checked (--build-only): run this again on a machine with the GPU to check it and write {env_file}")
        return 0
    name = gpu_name(args.device)
    if name is None:
        raise InstallError(f"no CUDA GPU {args.device} here to check DeepGEMM on: run this again on a GPU node (the "
                           "builds are reused), or pass --build-only to only build")
    env_file.unlink(missing_ok=True)  # a failed check must not leave an older, passing file behind
    reasons = []
    for candidate in candidates(prefix, source, toolchain.cxx):
        t1 = time.monotonic()
        reason = check(candidate, args.device, {**base, "CUDA_HOME": str(toolchain.cuda_home)}, args.check_timeout)
        say(f"check of {candidate.describe()}: {reason or 'passed'} ({time.monotonic() - t1:.0f} s)")
        if reason is None:
            path = write_env(prefix, candidate, name, deepgemm_version(candidate.path), source, toolchain.cuda_home)
            say(f"DeepGEMM works here as '{candidate.describe()}'.\nsource {path}\n"
                "then run with precision.fp8_backend=deepgemm")
            _export_if_asked(args, prefix, source, say)
            return 0
        reasons.append(f"{candidate.describe()}: {reason}")
    raise InstallError("no DeepGEMM build passed the backend's check on " + name + ":\n  " + "\n  ".join(reasons))


def _export_if_asked(args: argparse.Namespace, prefix: Path, source: Path, say: Callable[[str], None]) -> None:
    if args.export_builds:
        say(f"builds written to {args.export_builds}: {', '.join(export_builds(prefix, source, args.export_builds))}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=Path, required=True, help="where the builds and deepgemm.env go")
    parser.add_argument("--source", type=Path, help="a DeepGEMM clone with its submodules (else one is cloned)")
    parser.add_argument("--commit", default=DEEPGEMM_COMMIT, help=f"what to clone (default {DEEPGEMM_COMMIT})")
    parser.add_argument("--device", type=int, default=0, help="the GPU to check it on")
    parser.add_argument("--check-timeout", type=float, default=300,
                        help="seconds for each build's check (its first run JIT-compiles three kernels)")
    parser.add_argument("--build-only", action="store_true", help="build, do not check (no GPU needed)")
    parser.add_argument("--rebuild", action="store_true", help="build again even where a build is there")
    parser.add_argument("--recheck", action="store_true", help="check again after a successful install")
    parser.add_argument("--export-builds", type=Path, metavar="ARCHIVE",
                        help="after a passing check, write the built extensions to this .tar.gz (for --prebuilt)")
    parser.add_argument("--prebuilt", type=Path, metavar="ARCHIVE",
                        help="take the builds from an --export-builds archive (same torch, CUDA and source) instead "
                             "of compiling; they are checked as any build")
    return parser.parse_args(argv)


def _tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "no log"


def main(argv: list[str]) -> int:
    try:
        return install(parse_args(argv), dict(os.environ))
    except InstallError as exc:
        print(f"install_deepgemm: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(run_tool(lambda: main(sys.argv[1:])))
