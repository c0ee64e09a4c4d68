"""Stop strings: one Aho–Corasick automaton per request, scanned a character at a time.

A request's stop strings become one ``StopStrings`` when it is admitted; each of its ``n``
sequences scans its text with its own ``StopMatcher``, which keeps its place in the automaton
between tokens. Every character of the text is scanned once, whatever the number of stop
strings, so a stop string that spans token boundaries is found where it completes.

The automaton is built lazily, from the sorted stop strings: a state is a prefix of some stop
string, named by the range of sorted stop strings that start with it, and a state, its failure
link and its transitions come into being when a text first reaches them (memoized, shared by
the request's sequences). Admission costs a sort; no request pays for states its texts never
reach (64 stop strings of 1024 characters would be a 64 Ki-state trie, 0.1 s of Python to
build eagerly). In all, a request does at most the work of the eager construction.

Which stop string ends a text: the one complete first, reading the text a character at a time
(so the answer does not depend on how the text was cut into tokens); of several complete at the
same character, the longest.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right


class StopStrings:
    """The automaton of one request's stop strings (shared by its sequences)."""

    def __init__(self, stops: list[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = sorted(set(stops))
        self.max_len = max(map(len, self.stops), default=0)
        # Per state: the range [lo, hi) of self.stops that start with its prefix, the prefix's
        # length, its failure link (the state of its longest proper suffix that is a state),
        # the length of the longest stop string it ends with (0: none) and its transitions so
        # far (failure links followed), character -> state.
        self._lo, self._hi, self._depth = [0], [len(self.stops)], [0]
        self._fail, self._longest = [0], [0]
        self._goto: list[dict[str, int]] = [{}]
        self._state_of: dict[tuple[int, int], int] = {}  # (lo, depth) -> state
        self.steps = 0  # failure links followed and states made: the work beyond one lookup a character

    @property
    def num_states(self) -> int:
        return len(self._depth)

    def matcher(self) -> StopMatcher:
        return StopMatcher(self)

    def _child_range(self, state: int, char: str) -> tuple[int, int] | None:
        """The stop strings that continue this state's prefix with ``char``."""
        depth, lo, hi = self._depth[state], self._lo[state], self._hi[state]
        stops = self.stops
        if len(stops[lo]) == depth:  # the prefix is a stop string itself: it sorts first, and ends here
            lo += 1
        # Every stop string in [lo, hi) shares the prefix and is longer: ordered by its next character.
        start = bisect_left(stops, char, lo, hi, key=lambda s: s[depth])
        if start == hi or stops[start][depth] != char:
            return None
        return start, bisect_right(stops, char, start, hi, key=lambda s: s[depth])

    def next_state(self, state: int, char: str) -> int:
        """The transition from ``state`` along ``char``, failure links followed; what it needs
        that does not exist yet is made (without recursion: a chain of failure links is as
        long as the longest stop string)."""
        goto = self._goto
        known = goto[state].get(char)
        if known is not None:
            return known
        # Down the failure chain until the answer is known. A state with a child along char that
        # is not made yet needs the answer of the rest of the chain for the child's failure link.
        frames: list[tuple[int, tuple[int, int] | None]] = []  # (state, the range of its new child, or None)
        v = state
        while True:
            self.steps += 1
            known = goto[v].get(char)
            if known is not None:
                result = known
                break
            child = self._child_range(v, char)
            if child is not None:
                made = self._state_of.get((child[0], self._depth[v] + 1))
                if made is not None:
                    result = made
                    goto[v][char] = made
                    break
            frames.append((v, child))
            if v == 0:
                result = 0  # the root's own child (if any) fails to the root
                break
            v = self._fail[v]
        for v, child in reversed(frames):
            if child is not None:
                result = self._make(child, self._depth[v] + 1, fail=result)
            goto[v][char] = result
        return result

    def _make(self, span: tuple[int, int], depth: int, fail: int) -> int:
        self.steps += 1
        state = len(self._depth)
        lo, hi = span
        self._lo.append(lo)
        self._hi.append(hi)
        self._depth.append(depth)
        self._fail.append(fail)
        self._longest.append(depth if len(self.stops[lo]) == depth else self._longest[fail])
        self._goto.append({})
        self._state_of[(lo, depth)] = state
        return state


class StopMatcher:
    """One sequence's scan: ``feed`` each new piece of its text once, in order."""

    __slots__ = ("automaton", "state", "scanned")

    def __init__(self, automaton: StopStrings) -> None:
        self.automaton = automaton
        self.state = 0
        self.scanned = 0  # characters fed so far

    def feed(self, text: str, report: bool = True) -> tuple[int, int] | None:
        """Scan ``text``, the characters that follow those fed so far. Returns ``(end, length)``
        of the first stop string that completes inside it (``end``: its end's offset in
        ``text``, exclusive; the longest of those complete at the same character), and stops
        scanning there; or None. With ``report`` False the scan only keeps its place (stop
        strings do not count yet: min_tokens)."""
        automaton = self.automaton
        goto, longest = automaton._goto, automaton._longest
        state = self.state
        for i, char in enumerate(text):
            nxt = goto[state].get(char)
            state = automaton.next_state(state, char) if nxt is None else nxt
            if report and longest[state]:
                self.state, self.scanned = state, self.scanned + i + 1
                return i + 1, longest[state]
        self.state, self.scanned = state, self.scanned + len(text)
        return None
