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


_TORCH_LOAD_DETAIL = "WeightsUnpickler error:"  # where torch's weights-only refusal names what it could not read


def torch_load_text(err: Exception) -> str:
    """Why `torch.load` could not read a file, in one line: its exception's type and first sentence, or for a
    weights-only refusal only the detail (its own text is a page that advises `weights_only=False`, which would let
    a corrupt or foreign file run code: never the advice for a checkpoint)."""
    text = str(err)
    if _TORCH_LOAD_DETAIL in text:
        detail = " ".join(text.split(_TORCH_LOAD_DETAIL, 1)[1].split("\n\n", 2)[:2]).split()
        return f"torch.load: {_TORCH_LOAD_DETAIL} {' '.join(detail)}"[:300]
    first = next((line.strip() for line in text.splitlines() if line.strip()), "").split(". ")[0]
    return f"torch.load: {type(err).__name__}" + (f": {first}"[:300] if first else "")
