"""How fast KV travels from each prefill instance to each decode instance, as the decode
instances measure it: their ``/status`` ``kv_transfer.pulls`` (per producer's KV address, totals
of pulls, tokens and seconds taken, pulls that timed out included). ``engine proxy`` reads them
and weighs a hand-off's expected transfer time when it picks the decode instance, so a slow,
congested or cut link counts against its path (docs/disaggregation.md, "Across machines").

A path's estimate is seconds per token over its recent pulls: each poll's new pulls are added to
sums that halve at every poll that brings new ones, so a long pull weighs more than a short one
and the recent past more than the old. Polls whose pulls averaged under MIN_SAMPLE_TOKENS are
left out (unless one timed out): a pull of a block or two is all fixed cost, and would make the
link look slow for a long prompt. A path not pulled over for FORGET_S is forgotten; an unknown
path is taken to be as fast as the best known, so a path avoided for being slow is tried again
once in a while and seen to have healed. Differences under SIGNIFICANT are none: noise between
two equal links must not decide which one gets every hand-off.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

FORGET_S = 60.0
DECAY = 0.5  # what the older pulls keep of their weight each time new ones come in
MIN_SAMPLE_TOKENS = 128  # per pull, on average over one poll's new pulls
SIGNIFICANT = 1.25  # a path counts as slower only past this many times the fastest one's time


@dataclass
class _Path:
    pulls: int  # the decode instance's totals at the last poll
    timeouts: int
    tokens: int
    seconds: float
    recent_tokens: float = 0.0  # decayed sums of the pulls since the proxy watches
    recent_seconds: float = 0.0
    updated: float = 0.0  # time.monotonic() of the last sample

    def seconds_per_token(self, now: float) -> float | None:
        if self.recent_tokens <= 0 or now - self.updated > FORGET_S:
            return None
        return self.recent_seconds / self.recent_tokens


def _totals(reported: object) -> tuple[int, int, int, float] | None:
    try:
        totals = (int(reported["pulls"]), int(reported.get("timeouts", 0)), int(reported["tokens"]),
                  float(reported["seconds"]))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return totals if min(totals) >= 0 and totals[3] < float("inf") else None


class TransferPaths:
    def __init__(self) -> None:
        self._paths: dict[tuple[str, str], _Path] = {}  # (decode url, producer's KV address)
        self._watched: set[str] = set()  # decode urls read at least once

    def observe(self, decode_url: str, pulls: object) -> None:
        """A decode instance's ``kv_transfer.pulls`` as its /status gave them. Its first reading
        is the baseline (pulls from before the proxy watched are not counted); a producer that
        appears later was first pulled from since. Totals that went down mean the instance
        restarted: a new baseline, the estimate kept. Producers it no longer reports (it keeps
        a bounded number) are dropped here too."""
        if not isinstance(pulls, dict):
            return
        first_reading = decode_url not in self._watched
        self._watched.add(decode_url)
        now = time.monotonic()
        for key in [k for k in self._paths if k[0] == decode_url and k[1] not in pulls]:
            del self._paths[key]
        for peer, reported in pulls.items():
            totals = _totals(reported)
            if totals is None or not isinstance(peer, str):
                continue
            path = self._paths.get((decode_url, peer))
            if path is None:
                path = self._paths[decode_url, peer] = _Path(*totals) if first_reading else _Path(0, 0, 0, 0.0)
            new_pulls, new_timeouts, new_tokens, new_seconds = (
                totals[0] - path.pulls, totals[1] - path.timeouts, totals[2] - path.tokens, totals[3] - path.seconds)
            path.pulls, path.timeouts, path.tokens, path.seconds = totals
            if new_pulls <= 0 or new_tokens <= 0 or new_seconds < 0 or new_timeouts < 0:
                continue  # nothing new, or restarted
            if new_tokens < MIN_SAMPLE_TOKENS * new_pulls and not new_timeouts:
                continue
            path.recent_tokens = DECAY * path.recent_tokens + new_tokens
            path.recent_seconds = DECAY * path.recent_seconds + new_seconds
            path.updated = now

    def excess_seconds(self, decode_urls: list[str], peer: str, tokens: int) -> dict[str, float]:
        """How much longer than over the fastest known path a pull of ``tokens`` from ``peer``
        is expected to take into each decode instance (0 where the path is unknown, or not
        SIGNIFICANT-ly slower)."""
        now = time.monotonic()
        expected = {}
        for url in decode_urls:
            path = self._paths.get((url, peer))
            per_token = path.seconds_per_token(now) if path is not None else None
            if per_token is not None:
                expected[url] = per_token * tokens
        best = min(expected.values(), default=0.0)
        return {url: expected[url] - best if expected.get(url, 0.0) > SIGNIFICANT * best else 0.0
                for url in decode_urls}

    def status(self) -> list[dict]:
        now = time.monotonic()
        rows = []
        for (url, peer), path in sorted(self._paths.items()):
            per_token = path.seconds_per_token(now)
            rows.append({"decode": url, "prefill_kv": peer, "pulls": path.pulls, "timeouts": path.timeouts,
                         "seconds_per_1k_tokens": None if per_token is None else round(per_token * 1000, 4)})
        return rows
