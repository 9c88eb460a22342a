"""Command-line helpers: number types for options (argparse `type=`: a bad value is one usage error naming the
option), `run_tool`, the tools' entry, and `print_warnings`."""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable, Optional

from megafp8.config.errors import ConfigError, os_error_text


def whole_number(at_least: int, hint: str = "") -> Callable[[str], int]:
    """A whole number of at least `at_least`, written as 100000000 or 1e8; `hint` follows a refusal."""
    def parse(text: str) -> int:
        try:
            value = int(text)  # exactly as written: a float keeps 53 bits (a seed of 20 digits came back another)
        except ValueError:
            value = _whole_float(text)
        if value < at_least:
            raise argparse.ArgumentTypeError(f"{text} must be at least {at_least}{hint}")
        return value
    return parse


def _whole_float(text: str) -> int:
    """A whole number written as a float (1e8), or an ArgumentTypeError saying why `text` is none."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 100000000 or 1e8)") from None
    if not math.isfinite(value) or not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text} is not a whole number")
    return int(value)


def positive_number(at_most: Optional[float] = None, hint: str = "") -> Callable[[str], float]:
    """A finite number above 0 (and at most `at_most`); `hint` follows a refusal of a value above it."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"{text} must be a number above 0")
        if at_most is not None and value > at_most:
            raise argparse.ArgumentTypeError(f"{text} must be at most {at_most:g}{hint}")
        return value
    return parse


def reported(body: Callable[[], int]) -> int:
    """`body()`'s exit status; a ConfigError, or a file system's OSError (read-only, full, no permission: its words
    and the path), printed as one `error:` line with exit status 2, not a traceback. A broken pipe goes on up to
    `run_tool`."""
    try:
        return body()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
    except BrokenPipeError:
        raise
    except OSError as err:
        print(f"error: {os_error_text(err)}", file=sys.stderr)
    return 2


def run_tool(main: Callable[[], Optional[int]]) -> int:
    """`main()`'s exit status; where its reader stops early (`tool | head`) the output ends quietly, as a Unix tool's
    does, not with "error: Broken pipe" or a traceback. Python's documented recipe: stdout goes to /dev/null so the
    interpreter's last flush at exit fails no more (SIGPIPE left as Python sets it: torch's sockets need that)."""
    try:
        status = main()
        sys.stdout.flush()  # here, not at exit, where a broken pipe could no longer be caught
        return status or 0
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def print_warnings(lines: list[str]) -> None:
    """Each of `lines` on stderr as `warning: <line>`: what a command took but says it will not do as written."""
    for line in lines:
        print(f"warning: {line}", file=sys.stderr, flush=True)
