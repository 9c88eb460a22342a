"""torch.compile's on-disk caches keyed to this megafp8's code.

torch keys its compile caches (Inductor's and AOTAutograd's) on the traced graph and its own configuration, not on
every source file the compiled code came from. In job HW a process running one source tree was served compiled code
that another tree's process had cached on the same machine: a backward calling the weight transpose with the four
arguments of the newer tree, against the three the older tree's op takes, which stopped the run; a change that kept
the arguments would have run the other tree's code silently. Each compiled block's compilation therefore adds a
hash of megafp8's Python sources to torch's `cache_key_tag` (after any tag the user set,
`TORCH_COMPILE_CACHE_KEY_TAG`): an upgrade, another branch or `ab_steps.py`'s second tree compiles afresh.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Callable


def source_fingerprint(root: Path) -> str:
    """A short hash of every Python source file under `root` (relative path and contents)."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


@functools.cache
def code_fingerprint() -> str:
    """`source_fingerprint` of the megafp8 package this process imported, read once."""
    return source_fingerprint(Path(__file__).resolve().parent.parent)


def keyed_to_this_code(compiled: Callable) -> Callable:
    """`compiled` (a `torch.compile`d function, compiled at its calls) run with this code's fingerprint in
    torch's cache keys, so its caches never serve code compiled from other megafp8 sources."""
    import torch

    tag = f"{torch.compiler.config.cache_key_tag}|megafp8:{code_fingerprint()}"

    def keyed(*args, **kwargs):  # (not functools.wraps: compiling this again must not see Dynamo's attributes)
        with torch.compiler.config.patch(cache_key_tag=tag):
            return compiled(*args, **kwargs)
    return keyed
