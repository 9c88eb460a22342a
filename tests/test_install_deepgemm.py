"""tools/install_deepgemm.py on the CPU, with a stand-in DeepGEMM source (its setup.py makes a file named like the
extension), a stand-in CUDA toolkit and compiler, and the deepgemm backend's child-process check answered per build:
both builds made side by side, the candidates checked least intrusive first, the first that passes written into a
file a shell sources, and each way it can fail said once, with what to do."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from megafp8.precision.backends import deepgemm_backend
from tools import install_deepgemm as tool

SETUP_PY = """import os, pathlib, sys
assert sys.argv[1:] == ["build"], sys.argv
if "-static-libstdc++" in os.environ.get("LDFLAGS", "") and os.environ.get("FAIL_STATIC"):
    sys.exit("static link failed")
out = pathlib.Path("build/lib.fake/deep_gemm")
out.mkdir(parents=True, exist_ok=True)
(out / "_C.fake.so").write_text(os.environ.get("LDFLAGS", "") + "|" + os.environ["CUDA_HOME"])
"""


def _source(root: Path, submodules: bool = True) -> Path:
    src = root / "DeepGEMM"
    for rel, text in {"setup.py": SETUP_PY, "deep_gemm/__init__.py": "__version__ = '2.6.1'\n",
                      "csrc/python_api.cpp": "", "deep_gemm/include/deep_gemm/x.cuh": ""}.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    if submodules:
        for rel in ("third-party/cutlass/include/cute/c.hpp", "third-party/cutlass/include/cutlass/c.h",
                    "third-party/fmt/include/fmt/f.h"):
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_text("")
    return src


def _toolchain(root: Path) -> dict[str, str]:
    """A CUDA_HOME with an nvcc, and a CXX that names a libstdc++ for `-print-file-name`."""
    cuda = root / "cuda"
    (cuda / "bin").mkdir(parents=True)
    (cuda / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (cuda / "bin" / "nvcc").chmod(0o755)
    libstdcxx = root / "gcc" / "libstdc++.so.6"
    libstdcxx.parent.mkdir()
    libstdcxx.write_text("")
    cxx = root / "cxx"
    cxx.write_text(f"#!/bin/sh\necho {libstdcxx}\n")
    cxx.chmod(0o755)
    return {"CUDA_HOME": str(cuda), "CXX": str(cxx), "PATH": "/usr/bin:/bin", "PYTHONPATH": "/site/mine"}


@pytest.fixture
def checks(monkeypatch):
    """The backend's check of each candidate, answered by `checks.answer(env)`; records the environments it saw."""
    real_run = subprocess.run

    class Checks:
        seen: list[dict] = []

        @staticmethod
        def answer(env):
            return 0, ""

    def run(command, **kwargs):
        if command[0] == sys.executable and "smoke_test(" in command[-1]:
            Checks.seen.append({**kwargs["env"], "timeout": kwargs["timeout"]})
            rc, err = Checks.answer(kwargs["env"])
            return subprocess.CompletedProcess(command, rc, "", err)
        return real_run(command, **kwargs)
    monkeypatch.setattr(deepgemm_backend.subprocess, "run", run)
    monkeypatch.setattr(tool, "gpu_name", lambda index: "NVIDIA H200")
    return Checks


def _install(argv, base, capsys):
    rc = tool.install(tool.parse_args(argv), base)
    return rc, capsys.readouterr().out


def test_it_builds_both_forms_checks_them_least_intrusive_first_and_writes_what_a_shell_sources(tmp_path, checks,
                                                                                                capsys):
    """As on the H200 machine: as it comes the check crashes, static fails, preloaded passes; the env file puts that
    build first on PYTHONPATH and preloads the compiler's libstdc++, keeping what both held."""
    src, base = _source(tmp_path), _toolchain(tmp_path)
    prefix = tmp_path / "dg"
    libstdcxx = str(tmp_path / "gcc" / "libstdc++.so.6")
    checks.answer = lambda env: ((0, "") if env.get("LD_PRELOAD") == libstdcxx else
                                 (-11, "") if str(prefix / "plain") in env["PYTHONPATH"] else (1, "Err: wrong here"))
    rc, out = _install(["--prefix", str(prefix), "--source", str(src)], base, capsys)
    assert rc == 0, out
    for variant, ldflags in (("plain", ""), ("static", "-static-libstdc++ -static-libgcc")):
        (so,) = (prefix / variant / "deep_gemm").glob("_C*.so")
        assert so.read_text() == f"{ldflags}|{base['CUDA_HOME']}"  # built in place, with the toolkit and flags given
        assert (prefix / variant / "deep_gemm/include/cute").resolve() == (
            prefix / variant / "third-party/cutlass/include/cute")
    tried = [(Path(env["PYTHONPATH"].split(":")[0]).name, env.get("LD_PRELOAD")) for env in checks.seen]
    assert tried == [("plain", None), ("static", None), ("plain", libstdcxx)]
    assert {env["timeout"] for env in checks.seen} == {300}  # --check-timeout's default, not the backend's 900 s
    assert all(env["PYTHONPATH"].split(":")[1:] == [str(tool.REPO_ROOT), "/site/mine"] for env in checks.seen)
    assert "SIGSEGV" in out and "Err: wrong here" in out and "source " + str(prefix / "deepgemm.env") in out
    sourced = subprocess.run(["bash", "-c", f'PYTHONPATH=/a LD_PRELOAD=/b.so; source {prefix}/deepgemm.env; '
                              'echo "$PYTHONPATH"; echo "$LD_PRELOAD"; echo "$CUDA_HOME"; command -v nvcc'],
                             capture_output=True, text=True, check=True)
    assert sourced.stdout.splitlines() == [f"{prefix / 'plain'}:/a", f"{libstdcxx} /b.so", base["CUDA_HOME"],
                                           f"{base['CUDA_HOME']}/bin/nvcc"]  # the toolkit its JIT was checked with
    assert "DeepGEMM 2.6.1" in (prefix / "deepgemm.env").read_text() and "NVIDIA H200" in (
        prefix / "deepgemm.env").read_text()

    checks.seen.clear()  # again: nothing to do
    rc, out = _install(["--prefix", str(prefix), "--source", str(src)], base, capsys)
    assert rc == 0 and "already installed" in out and checks.seen == []
    rc, out = _install(["--prefix", str(prefix), "--source", str(src), "--recheck"], base, capsys)
    assert rc == 0 and "plain: built before" in out and "static: built before" in out and len(checks.seen) == 3


def test_the_first_form_that_passes_needs_no_preload_and_a_failed_build_is_skipped(tmp_path, checks, capsys):
    src, base = _source(tmp_path), {**_toolchain(tmp_path), "FAIL_STATIC": "1"}
    prefix = tmp_path / "dg"
    rc, out = _install(["--prefix", str(prefix), "--source", str(src)], base, capsys)
    assert rc == 0 and "build failed, skipped: static" in out and "static link failed" in out
    assert len(checks.seen) == 1
    text = (prefix / "deepgemm.env").read_text()
    assert f'export PYTHONPATH="{prefix / "plain"}' in text and "LD_PRELOAD" not in text


def test_when_no_form_passes_it_says_why_for_each_and_leaves_no_env_file(tmp_path, checks, capsys):
    src, base = _source(tmp_path), _toolchain(tmp_path)
    prefix = tmp_path / "dg"
    prefix.mkdir()
    (prefix / "deepgemm.env").write_text("# an older install\n")
    checks.answer = lambda env: (1, "RuntimeError: DeepGEMM's 1x128 x 128x128 GEMM is wrong here")
    with pytest.raises(tool.InstallError, match="no DeepGEMM build passed the backend's check on NVIDIA H200") as err:
        tool.install(tool.parse_args(["--prefix", str(prefix), "--source", str(src)]), base)
    assert str(err.value).count("is wrong here") == 3
    assert not (prefix / "deepgemm.env").exists()  # no stale file that a run would source


def test_build_only_needs_no_gpu_and_a_check_without_one_says_where_to_run(tmp_path, checks, capsys, monkeypatch):
    src, base = _source(tmp_path), _toolchain(tmp_path)
    prefix = tmp_path / "dg"
    monkeypatch.setattr(tool, "gpu_name", lambda index: None)
    rc, out = _install(["--prefix", str(prefix), "--source", str(src), "--build-only"], base, capsys)
    assert rc == 0 and "not checked (--build-only)" in out and not (prefix / "deepgemm.env").exists()
    with pytest.raises(tool.InstallError, match="no CUDA GPU 0 here .* GPU node .* builds are reused"):
        tool.install(tool.parse_args(["--prefix", str(prefix), "--source", str(src)]), base)
    assert checks.seen == []


def test_bad_input_gets_one_line_that_says_what_to_do(tmp_path, capsys, monkeypatch):
    base = _toolchain(tmp_path)
    no_submodules = _source(tmp_path / "a", submodules=False)
    monkeypatch.setattr(tool.os, "environ", base)
    assert tool.main(["--prefix", str(tmp_path / "dg"), "--source", str(no_submodules)]) == 1
    err = capsys.readouterr().err
    assert "cutlass submodule's headers" in err and "git submodule update --init" in err
    assert tool.main(["--prefix", str(tmp_path / "dg"), "--source", str(tmp_path / "nowhere")]) == 1
    assert "nowhere does not exist: pass a clone" in capsys.readouterr().err
    monkeypatch.setattr(tool, "DEFAULT_CUDA_HOME", tmp_path / "no_cuda")
    with pytest.raises(tool.InstallError, match="need the CUDA toolkit's nvcc: set CUDA_HOME .*no_cuda"):
        tool.find_toolchain({"PATH": str(tmp_path / "empty"), "CXX": base["CXX"]})
    assert tool.find_toolchain({"PATH": str(Path(base["CUDA_HOME"]) / "bin"), "CXX": base["CXX"]}).cuda_home == Path(
        base["CUDA_HOME"])  # found through nvcc on PATH


def _gpu_lib_install(tmp_path, src, prefix, base):
    """benchmarks/gpu_lib.sh's `install_deepgemm` in a shell, nothing carried (the checkout's own .dg archives
    kept out); returns that shell's PYTHONPATH and LD_PRELOAD after it, and the summary it wrote."""
    (tmp_path / "out").mkdir(exist_ok=True)
    (tmp_path / "logs").mkdir(exist_ok=True)
    script = (f"OUT={tmp_path / 'out'}; source benchmarks/gpu_lib.sh; LOGS={tmp_path / 'logs'}; install_deepgemm; "
              'echo "$PYTHONPATH"; echo "${LD_PRELOAD:-}"')
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "DEEPGEMM_SRC": str(src),
           "DEEPGEMM_PREFIX": str(prefix), "CUDA_HOME": base["CUDA_HOME"], "CXX": base["CXX"], "HOME": str(tmp_path),
           "DEEPGEMM_PREBUILT": str(tmp_path / "none.tar.gz"), "DEEPGEMM_JIT_CACHE": str(tmp_path / "none.tar.gz"),
           "DG_JIT_CACHE_DIR": str(tmp_path / "jit")}
    done = subprocess.run(["bash", "-c", script], cwd=tool.REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines(), (tmp_path / "out" / "summary.md").read_text()


def test_the_gpu_scripts_use_the_tool_and_source_what_it_wrote(tmp_path, checks, capsys):
    """`install_deepgemm` (what every DeepGEMM part of the GPU scripts calls first) runs the tool on the carried
    source and sources its deepgemm.env, so the runs after it import that build with its preload; where the tool
    fails, the summary says why. (The check needs a GPU: here the tool's first run, with the check answered as on the
    H200 machine, is made in this process, and the script finds it installed.)"""
    src, base = _source(tmp_path), _toolchain(tmp_path)
    prefix = tmp_path / "dg"
    (pythonpath, preload), summary = _gpu_lib_install(tmp_path, src, prefix, base)
    assert "DeepGEMM: no build ran here" in summary and "no CUDA GPU 0 here" in summary, summary
    libstdcxx = str(tmp_path / "gcc" / "libstdc++.so.6")
    checks.answer = lambda env: (0, "") if env.get("LD_PRELOAD") == libstdcxx else (-11, "")
    assert _install(["--prefix", str(prefix), "--source", str(src)], base, capsys)[0] == 0
    (pythonpath, preload), summary = _gpu_lib_install(tmp_path, src, prefix, base)
    assert pythonpath == f"{prefix / 'plain'}:." and preload == libstdcxx
    assert "DeepGEMM ready in" in summary and "DeepGEMM 2.6.1, build 'plain, with" in summary, summary


def test_builds_exported_on_one_machine_are_placed_on_the_next_without_compiling_and_checked(tmp_path, checks,
                                                                                               capsys):
    """`--export-builds` after a passing check writes both extensions; `--prebuilt` on a fresh prefix places them
    (no setup.py runs: the stand-in fails if it does) and checks them as any build. Builds that fail the check here
    (another torch) say so, leave no env file, and `--rebuild` compiles."""
    src, base = _source(tmp_path), _toolchain(tmp_path)
    archive = tmp_path / "builds.tar.gz"
    rc, out = _install(["--prefix", str(tmp_path / "one"), "--source", str(src), "--export-builds", str(archive)],
                       base, capsys)
    assert rc == 0 and f"builds written to {archive}: plain, static" in out, out
    (src / "setup.py").write_text("import sys\nsys.exit('compiled, though prebuilt')\n")
    checks.seen.clear()
    fresh = tmp_path / "two"
    rc, out = _install(["--prefix", str(fresh), "--source", str(src), "--prebuilt", str(archive)], base, capsys)
    assert rc == 0 and "prebuilt from" in out and "plain, static" in out and "building" not in out, out
    for variant in tool.VARIANTS:
        (so,) = (fresh / variant / "deep_gemm").glob("_C*.so")
        assert so.read_text() == (tmp_path / "one" / variant / "deep_gemm" / so.name).read_text()
        assert (fresh / variant / "deep_gemm/include/cute").resolve() == (
            fresh / variant / "third-party/cutlass/include/cute")
    assert (fresh / "deepgemm.env").exists() and len(checks.seen) == 1

    checks.answer = lambda env: (1, "ImportError: undefined symbol")
    other = tmp_path / "three"
    with pytest.raises(tool.InstallError, match="no DeepGEMM build passed"):
        _install(["--prefix", str(other), "--source", str(src), "--prebuilt", str(archive)], base, capsys)
    assert not (other / "deepgemm.env").exists()
    with pytest.raises(tool.InstallError, match="no such file"):
        _install(["--prefix", str(other), "--source", str(src), "--prebuilt", str(tmp_path / "none.tar.gz")], base,
                 capsys)
    for keep in (100, len(archive.read_bytes()) - 200):  # a transfer cut short, early or late
        cut = tmp_path / f"cut{keep}.tar.gz"
        cut.write_bytes(archive.read_bytes()[:keep])
        where = tmp_path / f"four{keep}"
        with pytest.raises(tool.InstallError, match="not a readable archive"):
            _install(["--prefix", str(where), "--source", str(src), "--prebuilt", str(cut)], base, capsys)
        assert not any(tool.is_built(where / v, src.resolve()) for v in tool.VARIANTS)


def test_the_gpu_scripts_bring_deepgemm_back_and_a_carried_copy_replaces_the_build(tmp_path):
    """The shell's side (the tool's is the test above; its check needs a GPU, so a stand-in tool answers here, as
    told by PREBUILT_PASSES): a first call asks the tool to export its builds to $OUT and finish_summary packs the
    JIT cache; carried to the next call, the builds go to the tool as --prebuilt (no export asked) and the JIT cache
    is unpacked where DeepGEMM reads it; carried builds that fail there are built again (--rebuild), and the summary
    says so. DEEPGEMM_EXPORT=0 brings nothing back."""
    bin_dir, out, carried, jit = tmp_path / "bin", tmp_path / "out", tmp_path / "carried", tmp_path / "jit"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "python").write_text(f"""#!/usr/bin/env bash
if [ "$1" = tools/install_deepgemm.py ]; then
  echo "${{*:2}}" >> {calls}
  case " $* " in *" --prebuilt "*) [ "$PREBUILT_PASSES" = 1 ] || exit 1 ;; esac
  prefix=$3; mkdir -p "$prefix"; echo '# Made by a stand-in' > "$prefix/deepgemm.env"
  case " $* " in *" --export-builds "*) echo builds > "${{@: -1}}" ;; esac
  exit 0
fi
exec {sys.executable} "$@"
""")
    (bin_dir / "python").chmod(0o755)

    def call(prebuilt_passes: str, export: str = "1") -> str:
        out.mkdir(exist_ok=True)
        logs = tmp_path / "logs"
        logs.mkdir(exist_ok=True)
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(out), "DEEPGEMM_SRC": str(tmp_path),
               "DEEPGEMM_PREFIX": str(tmp_path / "dg"), "DEEPGEMM_PREBUILT": str(carried / "deepgemm_builds.tar.gz"),
               "DEEPGEMM_JIT_CACHE": str(carried / "deepgemm_jit_cache.tar.gz"), "DG_JIT_CACHE_DIR": str(jit),
               "PREBUILT_PASSES": prebuilt_passes, "DEEPGEMM_EXPORT": export}
        done = subprocess.run(["bash", "-c", f"source benchmarks/gpu_lib.sh; LOGS={logs}; install_deepgemm; "
                               "finish_summary"], cwd=tool.REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        return (out / "summary.md").read_text()

    assert "DeepGEMM ready in" in call("1")
    assert calls.read_text().split()[-2:] == ["--export-builds", str(out / "deepgemm_builds.tar.gz")]
    assert not (out / "deepgemm_jit_cache.tar.gz").exists()  # no kernel compiled: nothing to bring back
    (jit / "cache" / "kernel.x.1").mkdir(parents=True)
    (jit / "cache" / "kernel.x.1" / "kernel.cubin").write_text("sass")
    call("1")
    carried.mkdir()
    for name in ("deepgemm_builds.tar.gz", "deepgemm_jit_cache.tar.gz"):
        shutil.move(out / name, carried / name)
    shutil.rmtree(jit)
    shutil.rmtree(out)
    calls.unlink()

    summary = call("1")  # the next machine
    assert calls.read_text().splitlines() == [f"--prefix {tmp_path / 'dg'} --source {tmp_path} --prebuilt "
                                              f"{carried / 'deepgemm_builds.tar.gz'}"]
    assert "DeepGEMM ready in" in summary and "failed here" not in summary
    assert (jit / "cache" / "kernel.x.1" / "kernel.cubin").read_text() == "sass"
    assert not (out / "deepgemm_builds.tar.gz").exists()

    calls.unlink()
    summary = call("0")  # carried builds that do not run there
    assert [line.split()[4:] for line in calls.read_text().splitlines()] == [
        ["--prebuilt", str(carried / "deepgemm_builds.tar.gz")],
        ["--rebuild", "--export-builds", str(out / "deepgemm_builds.tar.gz")]]
    assert "deepgemm_builds.tar.gz failed here: building" in summary and summary.count("DeepGEMM ready in") == 2

    shutil.rmtree(out)  # DEEPGEMM_EXPORT=0: built, nothing brought back
    calls.unlink()
    carried_builds = carried / "deepgemm_builds.tar.gz"
    carried_builds.unlink()
    assert "DeepGEMM ready in" in call("1", export="0")
    assert calls.read_text().split()[4:] == [] and sorted(p.name for p in out.iterdir()) == ["logs.tar.gz",
                                                                                         "summary.md"]


def test_a_build_past_its_time_is_stopped_with_its_compilers_and_said(tmp_path, capsys, monkeypatch):
    """The build runs in its own process group, so a timeout kills what setup.py started too (a compiler left running
    would hold the machine), and the other build still counts."""
    src, base = _source(tmp_path), _toolchain(tmp_path)
    (src / "setup.py").write_text(SETUP_PY.replace('assert sys.argv', 'import subprocess, time\nif os.environ.get('
                                                   '"LDFLAGS"): subprocess.Popen(["sleep", "987"]); time.sleep(987)\n'
                                                   'assert sys.argv'))
    monkeypatch.setattr(tool, "BUILD_TIMEOUT_S", 3)
    prefix = tmp_path / "dg"
    tool.build_all(tool.check_source(src), prefix, tool.find_toolchain(base), False, base)
    out = capsys.readouterr().out
    assert "build failed, skipped: static (rc timeout after 3 s" in out
    assert tool.is_built(prefix / "plain", src.resolve()) and not tool.is_built(prefix / "static", src.resolve())
    assert "sleep 987" not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


@pytest.mark.parametrize("build_only", [False, True])
def test_a_changed_source_is_built_again_and_checked_again(tmp_path, checks, capsys, build_only):
    """A clone moved to another commit is built again. A --build-only of it (the login-node step of an upgrade)
    leaves no deepgemm.env that names the new builds as checked: the next run on the GPU checks them."""
    src, base = _source(tmp_path), _toolchain(tmp_path)
    commit = _git_repo_of(src)
    commit("one")
    prefix = tmp_path / "dg"
    assert _install(["--prefix", str(prefix), "--source", str(src)], base, capsys)[0] == 0
    commit("two")
    checks.seen.clear()
    rc, out = _install(["--prefix", str(prefix), "--source", str(src)] + ["--build-only"] * build_only, base, capsys)
    assert rc == 0 and "plain: building" in out and "already installed" not in out
    if build_only:
        assert not (prefix / "deepgemm.env").exists() and checks.seen == []
        rc, out = _install(["--prefix", str(prefix), "--source", str(src)], base, capsys)
        assert rc == 0 and "already installed" not in out
    assert len(checks.seen) == 1


def _git_repo_of(tree: Path) -> Callable[[str], str]:
    """`tree` made a git repository; returns a function that commits what the tree holds then (or nothing) and
    returns the commit."""
    git = ["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(tree)], check=True)

    def commit(message: str) -> str:
        subprocess.run(git + ["add", "-A"], check=True)
        subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", message], check=True)
        return subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    return commit


def _git_repo(path: Path) -> list[str]:
    """A DeepGEMM stand-in as a git repository with two commits that differ in csrc/version.txt; returns them,
    oldest first."""
    _source(path.parent, submodules=True)
    (path / "csrc" / "version.txt").write_text("one")
    commit = _git_repo_of(path)
    one = commit("one")
    (path / "csrc" / "version.txt").write_text("two")
    return [one, commit("two")]


def test_the_clone_is_at_the_commit_asked_for_and_a_failed_one_leaves_nothing(tmp_path, monkeypatch):
    upstream = tmp_path / "DeepGEMM"
    one, two = _git_repo(upstream)
    monkeypatch.setattr(tool, "DEEPGEMM_URL", str(upstream))
    dest = tmp_path / "prefix" / "src"
    dest.parent.mkdir()
    for commit in (one, two, two):  # the last one reuses the clone
        tool.clone(dest, commit)
        assert (dest / "csrc" / "version.txt").read_text() == ("one" if commit == one else "two")
    with pytest.raises(tool.InstallError, match="checkout -q no-such-commit` failed"):
        tool.clone(dest, "no-such-commit")
    assert not dest.exists()  # no clone at the wrong commit for a later run to take


def test_an_interrupted_build_leaves_no_compiler_running(tmp_path, capsys, monkeypatch):
    src, base = _source(tmp_path), _toolchain(tmp_path)
    (src / "setup.py").write_text('import subprocess, time\nsubprocess.Popen(["sleep", "986"]); time.sleep(986)\n')
    real_wait = subprocess.Popen.wait

    def interrupted(self, timeout=None):
        if timeout is not None:
            time.sleep(1)  # the builds have started their children
            raise KeyboardInterrupt
        return real_wait(self)
    monkeypatch.setattr(subprocess.Popen, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tool.build_all(tool.check_source(src), tmp_path / "dg", tool.find_toolchain(base), False, base)
    monkeypatch.setattr(subprocess.Popen, "wait", real_wait)
    assert "sleep 986" not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
