"""The statistics `tools/compare_runs.py` judges repeated runs with (no torch): Student's t's critical values,
Welch's standard error and degrees of freedom, the Mann-Whitney rank-sum test, and the runs an arm needs to resolve a
tolerance."""
from __future__ import annotations

import itertools
import math
import statistics


# Student's t at 97.5% (a two-sided 95% test) for 1 to 30 degrees of freedom: with three or four runs an arm the
# normal distribution's 1.96 would pass differences that are not resolved.
_T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
          2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


_Z_975 = 1.959963984540054  # the normal distribution's 97.5% point


def t_critical(dof: float) -> float:
    """The two-sided 95% critical value of Student's t at `dof` degrees of freedom, rounded down to a whole number
    (the conservative side). Beyond 30, the Cornish-Fisher expansion of t's quantile about the normal's (within 1e-5
    there): the normal's 1.96 itself, used there before, passed differences that t at 31-120 degrees does not
    (2.04-1.98)."""
    whole = max(1, math.floor(dof))
    if whole <= len(_T_975):
        return _T_975[whole - 1]
    z = _Z_975
    terms = ((z ** 3 + z) / 4, (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96,
             (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384,
             (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160)
    return z + sum(term / whole ** power for power, term in enumerate(terms, 1))


def welch(ref: list[float], other: list[float]) -> tuple[float, float]:
    """(the standard error of the difference of the two arms' means, its Welch-Satterthwaite degrees of freedom),
    in the values' own units. An arm of one run borrows the reference's sample variance, and the degrees of freedom
    are then the reference's alone."""
    ref_var = statistics.variance(ref)
    other_var = statistics.variance(other) if len(other) > 1 else ref_var
    a, b = ref_var / len(ref), other_var / len(other)
    if len(other) == 1:
        return math.sqrt(a + b), float(len(ref) - 1)
    if a + b == 0:
        return 0.0, float(len(ref) + len(other) - 2)
    return math.sqrt(a + b), (a + b) ** 2 / (a ** 2 / (len(ref) - 1) + b ** 2 / (len(other) - 1))


EXACT_RANK_LIMIT = 50_000  # arms whose ways of splitting the pooled runs number more than this get the normal form


def mann_whitney(ref: list[float], other: list[float]) -> tuple[float, float, bool]:
    """The rank-sum test of two arms (Mann-Whitney): (U, the pairs (other run, reference run) in which the other run
    is higher, a tie counting half; its two-sided p-value; whether that is exact). Exact: the share of all ways of
    splitting the pooled runs into arms of these sizes whose U lies at least as far from its mean (n m / 2) as this
    one; past `EXACT_RANK_LIMIT` ways, the normal approximation with continuity correction (no tie correction). It
    asks only which runs end higher, so one run far from the others moves it by one rank, not by its distance."""
    n, m = len(ref), len(other)
    center = n * m / 2
    ranks = _midranks(ref + other)  # U of a split: its runs' rank sum less the least it could be, m (m + 1) / 2
    u = sum(ranks[n:]) - m * (m + 1) / 2
    if math.comb(n + m, m) > EXACT_RANK_LIMIT:
        z = max(abs(u - center) - 0.5, 0.0) / math.sqrt(n * m * (n + m + 1) / 12)
        return u, math.erfc(z / math.sqrt(2)), False
    extreme = ways = 0
    for chosen in itertools.combinations(ranks, m):
        extreme += abs(sum(chosen) - m * (m + 1) / 2 - center) >= abs(u - center) - 1e-9
        ways += 1
    return u, extreme / ways, True


def _midranks(values: list[float]) -> list[float]:
    """Each value's rank (1-based) among `values`, tied values sharing the mean of their ranks."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for i in order[start:end + 1]:
            ranks[i] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def runs_to_resolve(deviation: float, tolerance: float) -> int:
    """The runs n an arm that two arms of sample deviation `deviation` take for the 95% bound (`t_critical` at
    2 n - 2 degrees of freedom times the standard error, deviation x sqrt(2 / n)) to come within `tolerance`: at
    least the large-sample rule's 8 deviation^2 / tolerance^2 (twice 1.96^2, rounded up), more where Student's t at
    that few runs is still well above 1.96 (the rule alone told arms of three runs that could not resolve the
    tolerance that two runs an arm would)."""
    n = max(2, math.ceil(8 * deviation ** 2 / tolerance ** 2))
    while t_critical(2 * n - 2) * deviation * math.sqrt(2 / n) > tolerance:
        n += 1
    return n
