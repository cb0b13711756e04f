"""The soak's verdict: a pure function of its per-minute records (no engines), one named
check per criterion, each with its figures.

A "minute" is one sampling interval (``--interval-s``). Minutes ``1..N`` (N =
``baseline_minutes``) are warm-up. The rates are judged by their *level*, the mean over a
window of K minutes (K = ``level_minutes``, default 3, fewer where the run is too short
for two windows that do not overlap):

```
| minute 1 .. minute N (warm-up) | N+1 .. N+K (reference) | ... | last K minutes (end) |
                                ^ RSS reference: the sample taken at the end of minute N
```

- ``throughput``: requests served a minute, averaged over the end window, at least
  ``(1 - max_throughput_drop)`` times the same average over the reference window.
- ``p99``: the minutes' p99 end-to-end latency, averaged over the end window, at most
  ``(1 + max_p99_rise)`` times the reference window's; every minute of both windows must
  have served something.
- ``rss:<role>`` (prefill, decode, router, each its own check): RSS at the end at most
  ``(1 + max_rss_growth)`` times the sample after minute N.
- ``rss_slope:<role>``: the least-squares slope of RSS over the last third of the minutes
  after the warm-up (at least 3 of them), in MiB an hour (a minute lasts
  ``interval_s``), at most ``max_rss_slope_mib_h``: a process still growing at the end
  fails even when its growth since the warm-up is within ``max_rss_growth`` (a leak that
  would pass a short run), and one that grew early and then levelled off passes.
- ``pools``: every engine's pool clean once the load stopped.
- ``errors``: no unintended error in the whole run, warm-up included.
- ``recompute_share``: handoffs the router recomputed (its fallback when a handoff fails)
  at most ``max_recompute_share`` of the requests served in the whole run, warm-up
  included; the default 0 fails a soak on its first recompute.

Throughput and p99 are rates, so their reference is taken wholly after the warm-up: a
fresh cluster serves at another rate than a warmed one (``docs/reliability.md``), and a
reference taken over the warm-up would count the end of the warm-up as slowing down.
Windows, not single minutes: on this 2-core machine one minute's p99 moved by 34% from
one minute to the next at the same load, and served requests by 10-20%
(``docs/reliability.md``), so a check of one minute against another judged the noise.
The end is compared, as for RSS, not every minute.

Borders: a change equal to its bound passes. Each limit (reference times ``1 +/- bound``,
or the share times the requests served) is rounded to six decimals before the
comparison, so that 900 served against 1000 is a drop of exactly 10%, not one float step
more.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

#: Decimals each limit is rounded to (see the module's docstring: borders).
LIMIT_DECIMALS = 6


@dataclass(frozen=True)
class Bounds:
    """How far the end of a soak may be from its reference and still pass."""

    #: Largest fall of served requests per minute, as a share of the reference minute's.
    max_throughput_drop: float = 0.10
    #: Largest rise of the p99 latency, as a share of the reference minute's.
    max_p99_rise: float = 0.10
    #: Largest growth of a process's RSS after the baseline that is not a leak.
    max_rss_growth: float = 0.05
    #: Largest RSS slope (MiB an hour) of a process over the last third of the run.
    max_rss_slope_mib_h: float = 60.0
    #: Largest share of served requests whose handoff the router recomputed.
    max_recompute_share: float = 0.0
    #: Minutes averaged into each level (reference and end) of throughput and p99.
    level_minutes: int = 3

    def __post_init__(self) -> None:
        if self.level_minutes < 1:
            raise ValueError(f"level_minutes must be >= 1, not {self.level_minutes}")
        if not 0.0 <= self.max_throughput_drop < 1.0:
            raise ValueError(f"max_throughput_drop must be in [0, 1), "
                             f"not {self.max_throughput_drop}")
        if not 0.0 <= self.max_recompute_share <= 1.0:
            raise ValueError(f"max_recompute_share must be in [0, 1], "
                             f"not {self.max_recompute_share}")
        for name in ("max_p99_rise", "max_rss_growth", "max_rss_slope_mib_h"):
            if getattr(self, name) < 0.0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class Check:
    """One criterion: its name, whether it passed, one line for people, and its figures
    (reference, end, change, bound, limit, ...) for the JSON."""

    name: str
    ok: bool
    detail: str
    figures: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Verdict:
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failed(self) -> list[str]:
        """Names of the checks that failed, in order."""
        return [c.name for c in self.checks if not c.ok]

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "failed": self.failed,
                "checks": [asdict(c) for c in self.checks]}

    def lines(self) -> list[str]:
        """The text report: one line per check."""
        width = max(len(c.name) for c in self.checks)
        return [f"{'PASS' if c.ok else 'FAIL'} {c.name:<{width}}  {c.detail}"
                for c in self.checks]


def _limit(reference: float, bound: float, sign: int) -> float:
    return round(reference * (1 + sign * bound), LIMIT_DECIMALS)


def _change(reference: float, end: float) -> float:
    return round((end - reference) / reference, 4)


def _span(ref: Sequence[Mapping[str, Any]], end: Sequence[Mapping[str, Any]]) -> str:
    def minutes(window: Sequence[Mapping[str, Any]]) -> str:
        first, last = window[0]["minute"], window[-1]["minute"]
        return f"{first}" if first == last else f"{first}-{last}"

    return f"minutes {minutes(ref)} -> {minutes(end)}"


def _level(window: Sequence[Mapping[str, Any]], field: str) -> float:
    return sum(m[field] for m in window) / len(window)


def _figures(ref: Sequence[Mapping[str, Any]], end: Sequence[Mapping[str, Any]],
             field: str, bound: float) -> dict[str, Any]:
    return {"reference_minutes": [m["minute"] for m in ref],
            "end_minutes": [m["minute"] for m in end],
            "reference": round(_level(ref, field), 6), "end": round(_level(end, field), 6),
            "bound": bound}


def _throughput(ref: Sequence[Mapping[str, Any]], end: Sequence[Mapping[str, Any]],
                bound: float) -> Check:
    span = _span(ref, end)
    figures = _figures(ref, end, "served", bound)
    before, after = figures["reference"], figures["end"]
    if not before:
        return Check("throughput", False, f"nothing served in the reference ({span})",
                     figures)
    limit = _limit(before, bound, -1)
    change = _change(before, after)
    figures.update(change=change, limit=limit)
    return Check("throughput", after >= limit,
                 f"{before:g} -> {after:g} served a minute ({span}): {change:+.1%}, "
                 f"bound -{bound:.0%} (at least {limit:g})", figures)


def _p99(ref: Sequence[Mapping[str, Any]], end: Sequence[Mapping[str, Any]],
         bound: float) -> Check:
    span = _span(ref, end)
    figures = _figures(ref, end, "p99_s", bound)
    if not all(m["served"] for m in (*ref, *end)):
        return Check("p99", False, f"no latency to compare: a minute of {span} served "
                                   "nothing", figures)
    before, after = figures["reference"], figures["end"]
    limit = _limit(before, bound, +1)
    change = _change(before, after)
    figures.update(change=change, limit=limit)
    return Check("p99", after <= limit,
                 f"{before:.3f} -> {after:.3f} s ({span}): {change:+.1%}, "
                 f"bound +{bound:.0%} (at most {limit:.3f} s)", figures)


def _rss(role: str, base: Mapping[str, Any], end: Mapping[str, Any], bound: float
         ) -> Check:
    before, after = base["rss_mib"][role], end["rss_mib"][role]
    limit = _limit(before, bound, +1)
    change = _change(before, after)
    return Check(f"rss:{role}", after <= limit,
                 f"{before:.1f} -> {after:.1f} MiB (after minute {base['minute']} -> "
                 f"{end['minute']}): {change:+.1%}, bound +{bound:.0%}",
                 {"reference_minute": base["minute"], "end_minute": end["minute"],
                  "reference": before, "end": after, "change": change, "bound": bound,
                  "limit": limit})


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` against ``xs``."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return (sum((x - mx) * (y - my) for x, y in zip(xs, ys))
            / sum((x - mx) ** 2 for x in xs))


def _rss_slope(role: str, tail: Sequence[Mapping[str, Any]], interval_s: float,
               bound: float) -> Check:
    if len(tail) < 2:
        return Check(f"rss_slope:{role}", True, "one minute after the warm-up: no slope "
                     "to judge", {"minutes": [m["minute"] for m in tail], "bound": bound})
    hours = [m["minute"] * interval_s / 3600 for m in tail]
    slope = round(_slope(hours, [m["rss_mib"][role] for m in tail]), 1)
    first, last = tail[0]["minute"], tail[-1]["minute"]
    return Check(f"rss_slope:{role}", slope <= bound,
                 f"{slope:+.1f} MiB/h over minutes {first}-{last} (least squares), bound "
                 f"{bound:g} MiB/h",
                 {"minutes": [m["minute"] for m in tail], "slope_mib_h": slope,
                  "bound": bound, "interval_s": interval_s})


def _pools(pools_clean: Mapping[str, bool]) -> Check:
    dirty = [role for role, clean in pools_clean.items() if not clean]
    detail = (f"not clean after the load: {', '.join(dirty)}" if dirty
              else f"clean after the load: {', '.join(pools_clean)}")
    return Check("pools", not dirty, detail, {"clean": dict(pools_clean)})


def _errors(minutes: Sequence[Mapping[str, Any]]) -> Check:
    errors = [e for m in minutes for e in m["errors"]]
    by_minute = {m["minute"]: len(m["errors"]) for m in minutes if m["errors"]}
    detail = (f"{len(errors)} unintended errors (by minute {by_minute}), e.g. {errors[:3]}"
              if errors else "no unintended error")
    return Check("errors", not errors, detail, {"count": len(errors), "by_minute": by_minute})


def _recompute_share(minutes: Sequence[Mapping[str, Any]], bound: float) -> Check:
    recomputed = sum(m["recomputed"] for m in minutes)
    served = sum(m["served"] for m in minutes)
    allowed = round(bound * served, LIMIT_DECIMALS)
    share = recomputed / served if served else 0.0
    return Check("recompute_share", recomputed <= allowed,
                 f"{recomputed} of {served} served handoffs recomputed ({share:.4%}), "
                 f"bound {bound:.2%} (at most {allowed:g})",
                 {"recomputed": recomputed, "served": served, "share": round(share, 6),
                  "bound": bound, "allowed": allowed})


def verdict(minutes: Sequence[Mapping[str, Any]], baseline_minutes: int,
            pools_clean: Mapping[str, bool], bounds: Bounds | None = None,
            interval_s: float = 60.0) -> Verdict:
    """The verdict of a soak from its per-minute records, in order from minute 1, each
    with ``minute``, ``served``, ``p99_s``, ``errors`` (a list), ``recomputed`` (a count)
    and ``rss_mib`` (MiB by process role), and whether each engine's pool (by role) was
    clean after the load; a minute lasted ``interval_s``. The module's docstring defines
    each check."""
    if baseline_minutes < 1:
        raise ValueError(f"baseline_minutes must be >= 1, not {baseline_minutes}")
    if len(minutes) <= baseline_minutes:
        raise ValueError(f"{len(minutes)} minutes leave none after a baseline of "
                         f"{baseline_minutes}")
    if not pools_clean:
        raise ValueError("no pool state: the verdict needs each engine's")
    bounds = bounds or Bounds()
    base, end = minutes[baseline_minutes - 1], minutes[-1]
    after = minutes[baseline_minutes:]
    k = max(1, min(bounds.level_minutes, len(after) // 2))
    ref_window, end_window = after[:k], after[-k:]
    tail = after[-max(3, -(-len(after) // 3)):]  # the last third, at least 3 minutes
    return Verdict((
        _throughput(ref_window, end_window, bounds.max_throughput_drop),
        _p99(ref_window, end_window, bounds.max_p99_rise),
        *(_rss(role, base, end, bounds.max_rss_growth) for role in base["rss_mib"]),
        *(_rss_slope(role, tail, interval_s, bounds.max_rss_slope_mib_h)
          for role in base["rss_mib"]),
        _pools(pools_clean),
        _errors(minutes),
        _recompute_share(minutes, bounds.max_recompute_share),
    ))
