"""The one exception type for bad user input (its message says what to change), and the suggestions messages make."""


class ConfigError(ValueError):
    """A setting, a file or a combination of them that cannot work; the message names the fix."""


def divisors_near(n: int, around: int) -> str:
    """Up to four divisors of n nearest to `around`, as text for a suggestion."""
    divs = [d for d in range(1, n + 1) if n % d == 0]
    near = sorted(sorted(divs, key=lambda d: abs(d - around))[:4])
    return ", ".join(map(str, near[:-1])) + (" or " if len(near) > 1 else "") + str(near[-1])
