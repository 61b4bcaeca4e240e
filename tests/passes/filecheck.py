"""FileCheck-style checks over a pass dump (``gemc.dump.format_graph``'s text).

Why: a whole-graph golden moves with every upstream change (a renamed node, one more view,
an annotation added by an earlier pass) and says nothing about what the test cares for. A
pass's intent is a few lines of its dump: "the linear and the gelu carry the same group",
"no node says jagged_attention". ``check_graph`` states those lines and nothing else.

Directives, one a line (blank lines ignored; anything else is an error, so a typo cannot
silently check nothing)::

    CHECK: pat          the first line at or after the current one that contains pat
    CHECK-NEXT: pat     the line right after the last match contains pat
    CHECK-SAME: pat     the last matched line contains pat after the previous match on it
    CHECK-NOT: pat      no line between the last match and the next positive match (or
                        the end of the text) contains pat
    CHECK-COUNT-n: pat  n CHECKs of pat in a row (follow with CHECK-NOT for "exactly n")

``pat`` is matched literally (as a substring: end it with the character that follows, as
in ``region=tower}``, to tell ``tower`` from ``tower.up``; surrounding blanks are dropped),
except ``{{regex}}`` parts, which are Python regular expressions
(``%{{\\w+}} = aten.linear``). The search is by line: after a CHECK matches, the next
CHECK looks from the following line, and CHECK-SAME from the end of the match.

Written here rather than taken from ``torch.testing.FileCheck``: that one lives in
TorchScript's C++ test utilities (``torch._C``), which are in maintenance mode and
undocumented; its failures name a character offset, not the directive and the dump lines;
and directives as a text block read as the statement of intent the test is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NoReturn

from torch import fx

from gemc.dump import format_graph

_DIRECTIVE = re.compile(r"^(CHECK(?:-NEXT|-SAME|-NOT|-COUNT-(\d+))?):\s?(.*)$")


@dataclass(frozen=True)
class Directive:
    kind: str  # CHECK, CHECK-NEXT, CHECK-SAME, CHECK-NOT
    pattern: re.Pattern[str]
    source: str  # the directive as written, for messages
    line: int  # 1-based line in the directives text


def _compile(pattern: str) -> re.Pattern[str]:
    """Literal text with ``{{regex}}`` parts."""
    parts, pos = [], 0
    for m in re.finditer(r"\{\{(.*?)\}\}", pattern):
        parts.append(re.escape(pattern[pos:m.start()]))
        parts.append(f"(?:{m.group(1)})")
        pos = m.end()
    parts.append(re.escape(pattern[pos:]))
    return re.compile("".join(parts))


def parse(directives: str) -> list[Directive]:
    """The directives of a text block, CHECK-COUNT-n expanded into n CHECKs."""
    out: list[Directive] = []
    for i, raw in enumerate(directives.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        m = _DIRECTIVE.match(line)
        if m is None:
            raise ValueError(f"directive line {i} is not CHECK[-NEXT|-SAME|-NOT|-COUNT-n]: "
                             f"{raw!r}")
        kind, count, pattern = m.group(1), m.group(2), m.group(3).strip()
        if not pattern:
            raise ValueError(f"directive line {i} has an empty pattern: {raw!r}")
        compiled = _compile(pattern)
        if count is not None:
            if int(count) < 1:
                raise ValueError(f"directive line {i}: CHECK-COUNT needs n >= 1: {raw!r}")
            out.extend(Directive("CHECK", compiled, line, i) for _ in range(int(count)))
        else:
            out.append(Directive(kind, compiled, line, i))
    if not out:
        raise ValueError("no directives: a check that checks nothing cannot fail")
    return out


class CheckFailure(AssertionError):
    """A directive did not hold; the message names it and shows where it looked."""


def _excerpt(lines: list[str], start: int, end: int, mark: int | None = None) -> str:
    start, end = max(0, start), min(len(lines), end)
    shown = [f"{'>' if k == mark else ' '}{k + 1:4d} | {lines[k]}" for k in range(start, end)]
    return "\n".join(shown) if shown else "    (no lines)"


def check_graph(text: str | fx.GraphModule, directives: str) -> None:
    """Raise :class:`CheckFailure` unless ``text`` (a dump, or a graph to dump) satisfies
    ``directives`` (see the module doc)."""
    if isinstance(text, fx.GraphModule):
        text = format_graph(text, "graph")
    lines = text.splitlines()
    checks = parse(directives)
    cur = -1  # index of the last matched line (-1: before the first)
    col = 0  # end of the last match on that line
    pending_not: list[Directive] = []

    def fail(d: Directive, why: str, start: int, end: int, mark: int | None = None) -> NoReturn:
        raise CheckFailure(f"directive line {d.line} `{d.source}` {why}:\n"
                           f"{_excerpt(lines, start, end, mark)}")

    def settle_nots(line: int, start: int) -> None:
        """The pending CHECK-NOTs hold from the last match to (``line``, ``start``): the
        next positive match, or the end of the text."""
        for d in pending_not:
            for k in range(max(cur, 0), min(line, len(lines) - 1) + 1):
                lo = col if k == cur else 0
                hi = start if k == line else len(lines[k])
                if d.pattern.search(lines[k][:hi], lo):
                    fail(d, "matched", k - 2, k + 3, k)
        pending_not.clear()

    for d in checks:
        if d.kind == "CHECK-NOT":
            pending_not.append(d)
            continue
        if d.kind == "CHECK-SAME":
            k = cur
            m = d.pattern.search(lines[cur], col) if cur >= 0 else None
            if m is None:
                fail(d, "not found on the last matched line", cur, cur + 1, cur)
        elif d.kind == "CHECK-NEXT":
            k = cur + 1
            m = d.pattern.search(lines[k]) if k < len(lines) else None
            if m is None:
                fail(d, "not on the next line", cur, cur + 3, k)
        else:
            k, m = cur + 1, None
            while k < len(lines):
                m = d.pattern.search(lines[k])
                if m is not None:
                    break
                k += 1
            if m is None:
                fail(d, "not found after the last match", cur, cur + 40)
        settle_nots(k, m.start())
        cur, col = k, m.end()
    settle_nots(len(lines), 0)
