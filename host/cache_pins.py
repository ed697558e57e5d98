"""``cache_control`` breakpoints as the station's TTL pins, and what the ``prefill`` event's
``pins`` reports make of them (pure: no I/O).

Each breakpoint names a prefix of the prompt: after the tools (``messages: 0, parts: 0``,
the template's preamble with the tools), or after a message (``messages: k + 1``). The
station's messages hold each message's content as one string (what ``/v1/chat/completions``
sends, so both dialects share sessions), so a breakpoint on a text block that does not end
its message cuts that string where the block ends (``messages: k, chars: n``: message ``k``
rendered with its first ``n`` characters); on another block (a tool result, an assistant's
text before its calls) it pins the prefix before that message (``messages: k``): less than
Anthropic caches, never more, and the answer's counts say what was pinned. Breakpoints that name one prefix
share one pin (the longest TTL, the first in the prompt). Pin ids digest the tenant and the
prefix (``host.session_names.pin_session``), so a repeated breakpoint finds its pin.

Usage, from the reports (contract of ``generate``'s ``pins``): ``cache_read_input_tokens``
is the most ``read_tokens`` of a pinned pin, ``cache_creation_input_tokens`` the most
``num_tokens`` less that; the creation is split by TTL (a 1h breakpoint never follows a 5m
one, so the 1h tokens come first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gnosis_daemon.wire.pins import PinReport
from host.anthropic_api import Breakpoint
from host.session_names import pin_session

DOWNGRADE_REASON = "pin_budget"  # the station's reason for a pin kept as an LRU session


@dataclass(frozen=True, slots=True)
class PinPlan:
    """The ``pins`` argument of ``generate`` and, per breakpoint, the pin it became."""

    pins: tuple[dict[str, Any], ...]
    of_breakpoint: tuple[int, ...]  # breakpoint i -> index into pins


def plan(breakpoints: tuple[Breakpoint, ...], messages: list[dict[str, Any]],
         tools: list[dict[str, Any]] | None, shift: int, tenant: str,
         ttl_s: dict[str, float]) -> PinPlan:
    """``messages``/``tools``: what the station renders (after the tools are written in;
    ``shift``: the messages put before the request's own, a system message holding the
    tools)."""
    pins: list[dict[str, Any]] = []
    by_cut: dict[tuple[int, int | None], int] = {}
    of_breakpoint = []
    for point in breakpoints:
        chars = None
        if point.message is None:
            cut = 0
        elif point.ends:
            cut = point.message + shift + 1
        else:  # inside message ``cut``: where its block ends, when that is known
            cut = point.message + shift
            chars = point.chars if cut < len(messages) else None
        if (cut, chars) not in by_cut:
            kept = messages[:cut]
            if chars is not None:
                kept = [*kept, {**messages[cut], "content": str(messages[cut]["content"])[:chars]}]
            by_cut[cut, chars] = len(pins)
            pin: dict[str, Any] = {"session_id": pin_session(tenant, (tools, kept)),
                                   "ttl_s": ttl_s[point.ttl], "messages": cut, "parts": 0}
            if chars is not None:
                pin = {**pin, "chars": chars}
                del pin["parts"]
            pins.append(pin)
        of_breakpoint.append(by_cut[cut, chars])
    return PinPlan(tuple(pins), tuple(of_breakpoint))


@dataclass(slots=True)
class PinUsage:
    """Anthropic's cache counts and the ``_gnosis`` block's ``cache_pins``."""

    read: int = 0
    creation_5m: int = 0
    creation_1h: int = 0
    cache_pins: list[dict[str, Any]] = field(default_factory=list)
    outcomes: list[tuple[str, str]] = field(default_factory=list)  # (ttl, outcome): metrics

    @property
    def creation(self) -> int:
        return self.creation_5m + self.creation_1h


def usage(breakpoints: tuple[Breakpoint, ...], pin_plan: PinPlan | None,
          reports: tuple[PinReport, ...], unavailable: str | None) -> PinUsage:
    """The counts of a request whose pins were sent (``pin_plan``), or, when they could not
    be (``unavailable``: why), every breakpoint refused with that reason."""
    out = PinUsage()
    if pin_plan is None or len(reports) != len(pin_plan.pins):
        why = unavailable or "the station reported no pins"
        for point in breakpoints:
            out.cache_pins.append({"ttl": point.ttl, "tokens": 0, "pinned": False,
                                   "reason": why})
            out.outcomes.append((point.ttl, "refused"))
        return out
    pinned = [(point.ttl, reports[i]) for point, i in zip(breakpoints, pin_plan.of_breakpoint)
              if reports[i].pinned]
    out.read = max((r.read_tokens for _, r in pinned), default=0)
    longest = max((r.num_tokens for _, r in pinned), default=0)
    longest_1h = max((r.num_tokens for ttl, r in pinned if ttl == "1h"), default=0)
    out.creation_1h = max(0, longest_1h - out.read)
    out.creation_5m = max(0, longest - out.read) - out.creation_1h
    for point, i in zip(breakpoints, pin_plan.of_breakpoint):
        report = reports[i]
        out.cache_pins.append({"ttl": point.ttl, "tokens": report.num_tokens,
                               "pinned": report.pinned, "reason": report.reason})
        out.outcomes.append((point.ttl, outcome(report)))
    return out


def outcome(report: PinReport) -> str:
    """created | read | downgraded | refused (``host.metrics.PIN_OUTCOMES``): read when a
    live pin served any of the prefix, as the other dialects count it (``host.retention``)."""
    if report.pinned:
        return "read" if report.read_tokens > 0 else "created"
    return "downgraded" if report.reason == DOWNGRADE_REASON else "refused"
