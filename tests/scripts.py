"""Run the repository's scripts (`python tools/x.py ARGS`) several times at the cost of importing torch once.

A fresh interpreter per invocation spends ~4 s of CPU importing torch and megafp8, nearly all of a quick
invocation's time on a 2-core CI machine. `run_scripts` starts one driver interpreter that imports them and then
forks one child per invocation: each child runs the script as `python SCRIPT ARGS` from the repository root would
(the script as __main__, its own sys.argv and sys.path[0], stdout and stderr at the file descriptors, its exit status
the process's), so no invocation sees another's state. What differs is only that the imports happened before the
fork: the driver's own output while importing would otherwise have been every invocation's, so it must be empty.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Sequence, Union

from tests.conftest import REPO, torchrun_env

# Imported once in the driver, before any fork. No torch operation runs there, so no thread pool exists to fork.
PRELOAD = ["torch", "megafp8.train.main", "megafp8.checkpoint.convert"]

DRIVER = r"""
import atexit, json, os, runpy, sys, tempfile, traceback

for name in json.loads(sys.argv[1]):
    __import__(name)
report, results = os.fdopen(os.dup(1), "w"), []
for script, *args in json.loads(sys.stdin.read()):
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the invocation, exiting as the interpreter would at the end of `python script args`
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            sys.argv, sys.path[0] = [script, *args], os.path.dirname(os.path.abspath(script))
            code = 0
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as exit:
                code = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
                if exit.code is not None and not isinstance(exit.code, int):
                    print(exit.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                code = 1
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        results.append({"returncode": os.waitstatus_to_exitcode(status), "stdout": out.read(), "stderr": err.read()})
json.dump(results, report)
"""


def run_scripts(invocations: Sequence[Sequence[Union[str, Path]]],
                timeout_s: float = 300) -> list[subprocess.CompletedProcess]:
    """Each `(script, *args)` (the script relative to the repository root) run in turn, as by
    `subprocess.run([sys.executable, script, *args], cwd=REPO, env=torchrun_env())`; their results in order."""
    argvs = [[str(arg) for arg in invocation] for invocation in invocations]
    driver = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(PRELOAD)], input=json.dumps(argvs), cwd=REPO,
                            env=torchrun_env(), capture_output=True, text=True, timeout=timeout_s)
    assert driver.returncode == 0 and driver.stderr == "", f"the script driver failed:\n{driver.stderr}"
    return [subprocess.CompletedProcess([sys.executable, *argv], **result)
            for argv, result in zip(argvs, json.loads(driver.stdout))]


def run_in_triton_interpreter(tmp_path: Path, source: str, *args: str) -> None:
    """Run `source` (a script that prints "ok" when its checks pass) in a fresh interpreter with Triton's CPU
    interpreter on (`TRITON_INTERPRET=1`: chosen at import, hence the subprocess), with the repository and Triton
    importable; fails with the end of its error output otherwise. Skips where Triton is not installed."""
    import os

    import pytest

    triton = pytest.importorskip("triton")
    script = tmp_path / "interpreted.py"
    script.write_text(source)
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.path.dirname(os.path.dirname(triton.__file__))]))
    result = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
