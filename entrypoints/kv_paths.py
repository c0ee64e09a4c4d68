"""How fast KV travels from each prefill instance to each decode instance, as the decode
instances measure it: their ``/status`` ``kv_transfer.pulls`` (per producer's KV address, totals
of tokens pulled and seconds taken). ``engine proxy`` reads them and weighs a hand-off's expected
transfer time when it picks the decode instance, so a slow or congested link counts against its
path (docs/disaggregation.md, "Across machines").

A path's estimate is seconds per token over its recent pulls: each poll's new pulls are added to
sums that halve at every poll that brings new ones, so a long pull weighs more than a short one
(whose fixed costs would overstate the per-token time) and the recent past more than the old. A
path not pulled over for FORGET_S is forgotten; an unknown path is taken to be as fast as the best
known, so a path avoided for being slow is tried again once in a while and seen to have healed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

FORGET_S = 60.0
DECAY = 0.5  # what the older pulls keep of their weight each time new ones come in


@dataclass
class _Path:
    tokens: int  # the decode instance's totals at the last poll
    seconds: float
    recent_tokens: float = 0.0  # decayed sums of the pulls since the proxy watches
    recent_seconds: float = 0.0
    updated: float = 0.0  # time.monotonic() of the last new pull

    def seconds_per_token(self, now: float) -> float | None:
        if self.recent_tokens <= 0 or now - self.updated > FORGET_S:
            return None
        return self.recent_seconds / self.recent_tokens


class TransferPaths:
    def __init__(self) -> None:
        self._paths: dict[tuple[str, str], _Path] = {}  # (decode url, producer's KV address)
        self._watched: set[str] = set()  # decode urls read at least once

    def observe(self, decode_url: str, pulls: object) -> None:
        """A decode instance's ``kv_transfer.pulls`` as its /status gave them. Its first reading
        is the baseline (pulls from before the proxy watched are not counted); a producer that
        appears later was first pulled from since. Totals that went down mean the instance
        restarted: a new baseline, the estimate kept."""
        if not isinstance(pulls, dict):
            return
        first_reading = decode_url not in self._watched
        self._watched.add(decode_url)
        now = time.monotonic()
        for peer, totals in pulls.items():
            try:
                tokens, seconds = int(totals["tokens"]), float(totals["seconds"])
            except (KeyError, TypeError, ValueError):
                continue
            path = self._paths.get((decode_url, peer))
            if path is None:
                path = self._paths[decode_url, peer] = _Path(tokens, seconds) if first_reading else _Path(0, 0.0)
            new_tokens, new_seconds = tokens - path.tokens, seconds - path.seconds
            path.tokens, path.seconds = tokens, seconds
            if new_tokens <= 0 or new_seconds < 0:
                continue
            path.recent_tokens = DECAY * path.recent_tokens + new_tokens
            path.recent_seconds = DECAY * path.recent_seconds + new_seconds
            path.updated = now

    def excess_seconds(self, decode_urls: list[str], peer: str, tokens: int) -> dict[str, float]:
        """How much longer than over the fastest known path a pull of ``tokens`` from ``peer``
        is expected to take into each decode instance (0 where the path is unknown)."""
        now = time.monotonic()
        expected = {}
        for url in decode_urls:
            path = self._paths.get((url, peer))
            per_token = path.seconds_per_token(now) if path is not None else None
            if per_token is not None:
                expected[url] = per_token * tokens
        best = min(expected.values(), default=0.0)
        return {url: expected[url] - best if url in expected else 0.0 for url in decode_urls}

    def status(self) -> list[dict]:
        now = time.monotonic()
        return [{"decode": url, "prefill_kv": peer, "pulled_tokens": path.tokens,
                 "seconds_per_1k_tokens": None if (spt := path.seconds_per_token(now)) is None else round(spt * 1000, 4)}
                for (url, peer), path in sorted(self._paths.items())]
