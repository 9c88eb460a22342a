"""The one exception type for bad user input (its message says what to change), and the suggestions messages make."""


class ConfigError(ValueError):
    """A setting, a file or a combination of them that cannot work; the message names the fix."""


def nearest(values: list[int], around: int) -> str:
    """Up to four of `values` (at least one) nearest to `around`, in order, as text for a suggestion."""
    near = sorted(sorted(values, key=lambda v: abs(v - around))[:4])
    return ", ".join(map(str, near[:-1])) + (" or " if len(near) > 1 else "") + str(near[-1])


def divisors_near(n: int, around: int) -> str:
    """Up to four divisors of n nearest to `around`, as text for a suggestion."""
    return nearest([d for d in range(1, n + 1) if n % d == 0], around)


def os_error_text(err: OSError) -> str:
    """An OSError in one line for a command-line tool: the system's words and the path(s), e.g.
    `out/a.pt: Read-only file system` where the exception's own text is `[Errno 30] Read-only file system: 'out/a.pt'`."""
    paths = " -> ".join(str(p) for p in (err.filename, err.filename2) if p is not None)
    what = err.strerror or str(err)
    return f"{paths}: {what}" if paths else what
