"""Load or recompute: whether KV a tier (or a peer) holds is worth loading, as this instance
measures its sources and its own prefill while it runs.

- ``SourceRate``: a source's load rate in bytes/s, over its recent transfers (decayed sums of
  bytes and seconds, so a large transfer weighs more than a small one and the recent past more
  than the old). Until its first sample it is a conservative seed for its kind.
- ``PrefillCost``: the seconds a forward pass spends per step, fitted by least squares over the
  recent steps as ``c0 + a * tokens + b * attended pairs``, where a request computing ``n``
  tokens after ``ctx`` cached ones attends ``n * ctx + n (n + 1) / 2`` query-key pairs: the
  linear term is the weights' work per token, the quadratic one attention's, which grows with
  the context. A prefix's recompute cost is the marginal ``a * n + b * pairs`` (the step's own
  fixed cost ``c0`` is paid either way: the last token is always computed).
- ``LoadPlanner``: given the chunks a request could load, in order (where each ends, the bytes
  each read costs, its source), the number to load that minimises the expected time to have the
  whole prompt computed: ``sum of load times of the chunks loaded + recompute of the rest``. It
  loads everything (today's behaviour) while the prefill is not measured yet, and always when
  turned off (``--kv-always-load``).

Correctness does not depend on any of it: loaded and recomputed KV are the same (fp32), so a
wrong estimate only costs time.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

# Seeds per kind of source, bytes/s: below what each usually does (memory copies run at several
# GB/s, local NVMe at 1-3 GB/s, a LAN at 100 MB/s-1 GB/s), so before its first transfer a source
# is not taken to be faster than it is likely to be.
SEED_RATES = {"cpu": 1e9, "disk": 2e8, "redis": 5e7, "peer": 5e7}
DEFAULT_SEED_RATE = 5e7
RATE_DECAY = 0.7  # what the older samples keep of their weight at each new one
PREFILL_WINDOW = 256  # steps the prefill fit is made over
FULL_FIT_STEPS = 3  # prefill steps before all three terms are fitted (fewer: a cost per token alone)
MIN_PREFILL_TOKENS = 16  # a step computing at least this many tokens counts as a prefill
EXPLORE_EVERY = 16  # every 16th decision that could decline loads anyway, to re-measure its sources
REFIT_EVERY = 8  # steps between refits (a 3x3 solve, microseconds: only to keep the step loop lean)


class SourceRate:
    def __init__(self, kind: str) -> None:
        self.seed = SEED_RATES.get(kind, DEFAULT_SEED_RATE)
        self._bytes = 0.0
        self._seconds = 0.0
        self.samples = 0

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        self._bytes = RATE_DECAY * self._bytes + nbytes
        self._seconds = RATE_DECAY * self._seconds + seconds
        self.samples += 1

    @property
    def bytes_per_s(self) -> float:
        return self._bytes / self._seconds if self.samples else self.seed


@dataclass(frozen=True, slots=True)
class PrefillFit:
    c0: float = 0.0  # seconds per step
    per_token: float = 0.0  # seconds per token computed
    per_pair: float = 0.0  # seconds per query-key pair attended

    def seconds(self, start: int, end: int) -> float:
        """Marginal seconds to compute tokens [start, end) after ``start`` cached ones."""
        n = max(0, end - start)
        return self.per_token * n + self.per_pair * attended_pairs(n, start)


def attended_pairs(n: int, ctx: int) -> float:
    """Query-key pairs ``n`` causal queries after ``ctx`` cached tokens attend."""
    return n * ctx + n * (n + 1) / 2


class PrefillCost:
    """Fitted from (tokens, pairs, seconds) of recent prefill steps (at least MIN_PREFILL_TOKENS
    computed): decode steps are left out, their attention is bound by memory, not arithmetic,
    and a window of decodes alone would extrapolate a prefill from them. Coefficients never go
    negative: a term the data makes negative is dropped and the others refitted."""

    def __init__(self, window: int = PREFILL_WINDOW) -> None:
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._since_fit = 0
        self.fit: PrefillFit | None = None

    def observe(self, tokens: int, pairs: float, seconds: float) -> None:
        if tokens < MIN_PREFILL_TOKENS or seconds <= 0:
            return
        self._steps.append((float(tokens), float(pairs), seconds))
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY or self.fit is None:
            self._refit()

    def _refit(self) -> None:
        self._since_fit = 0
        if not self._steps:
            return
        data = np.array(self._steps)
        if len(data) < FULL_FIT_STEPS:  # too few points for three terms: all of the cost per token
            self.fit = PrefillFit(0.0, float(data[:, 2].sum() / data[:, 0].sum()), 0.0)
            return
        x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        y = data[:, 2]
        keep = [0, 1, 2]
        coef = np.zeros(3)
        while keep:
            solved, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
            if (solved >= 0).all():
                coef[:] = 0
                coef[keep] = solved
                break
            keep.remove(keep[int(np.argmin(solved))])
        if coef[1] == 0 and coef[2] == 0:
            # Too little spread to tell the terms apart (every step alike): all of the cost per token.
            coef = np.array([0.0, float(y.sum() / data[:, 0].sum()), 0.0])
        self.fit = PrefillFit(float(coef[0]), float(coef[1]), float(coef[2]))


@dataclass(frozen=True, slots=True)
class LoadOption:
    """One chunk a request could load, in order: loading it brings the request's computed
    tokens up to ``end_token``; reading it costs ``nbytes`` from ``source``."""
    end_token: int
    nbytes: int
    source: str


@dataclass(slots=True)
class Decisions:
    """Totals since start, per admission that had something to load."""
    load: int = 0       # loaded all it could
    partial: int = 0    # loaded a first part, computed the rest
    recompute: int = 0  # loaded nothing
    tokens_loaded: int = 0
    tokens_recomputed: int = 0  # available from a source, computed instead


class LoadPlanner:
    """Shared by the engine core (it feeds the prefill steps) and the connectors' scheduler
    halves (they feed transfers and ask). All on the engine's step thread; the lock only guards
    readers of ``snapshot`` on others."""

    def __init__(self, always_load: bool = False, bytes_per_token: float = 0.0) -> None:
        self.always_load = always_load
        self.bytes_per_token = bytes_per_token  # of the stored chunks: what routers weigh a tier hit by
        self.prefill = PrefillCost()
        self.rates: dict[str, SourceRate] = {}
        self.decisions = Decisions()
        self._declined = 0  # decisions that left something unloaded
        self._lock = threading.Lock()

    def rate(self, source: str) -> SourceRate:
        """``source``: a tier's name (cpu, disk, redis) or ``peer:<address>``."""
        rate = self.rates.get(source)
        if rate is None:
            rate = self.rates[source] = SourceRate(source.split(":", 1)[0])
        return rate

    def observe_transfer(self, source: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.rate(source).observe(nbytes, seconds)

    def observe_step(self, tokens: int, pairs: float, seconds: float) -> None:
        with self._lock:
            self.prefill.observe(tokens, pairs, seconds)

    def plan(self, num_computed: int, num_tokens: int, options: list[LoadOption]) -> int:
        """How many of ``options`` to load (a prefix of them): the count with the least expected
        time to have ``num_tokens`` computed. Ties go to loading more. All of them while off, or
        while the prefill is not measured yet."""
        fit = self.prefill.fit
        if not options or self.always_load or fit is None:
            return len(options)
        sources = {option.source for option in options}
        if any(self.rate(source).samples == 0 for source in sources):
            return len(options)  # a source never read from: load (which measures it)
        best, best_s = 0, fit.seconds(num_computed, num_tokens)
        loading_s = 0.0
        for k, option in enumerate(options, 1):
            loading_s += option.nbytes / self.rate(option.source).bytes_per_s
            total = loading_s + fit.seconds(option.end_token, num_tokens)
            if total <= best_s:
                best, best_s = k, total
        if best < len(options):
            self._declined += 1
            if self._declined % EXPLORE_EVERY == 0:
                return len(options)  # now and then anyway: a link that got faster is seen again
        return best

    def count(self, num_computed: int, options: list[LoadOption], loaded: int) -> None:
        """One admission's decision: ``loaded`` of ``options`` were loaded."""
        if not options:
            return
        d = self.decisions
        end = options[loaded - 1].end_token if loaded else num_computed
        with self._lock:
            if loaded == len(options):
                d.load += 1
            elif loaded:
                d.partial += 1
            else:
                d.recompute += 1
            d.tokens_loaded += end - num_computed
            d.tokens_recomputed += options[-1].end_token - end

    def snapshot(self) -> dict:
        """What /status and the metrics show: the decisions, each source's rate and the prefill fit."""
        with self._lock:
            fit = self.prefill.fit
            d = self.decisions
            return {
                "enabled": not self.always_load, "bytes_per_token": self.bytes_per_token,
                "decisions": {"load": d.load, "partial": d.partial, "recompute": d.recompute},
                "tokens_loaded": d.tokens_loaded, "tokens_recomputed": d.tokens_recomputed,
                "sources": {name: {"bytes_per_s": r.bytes_per_s, "measured": r.samples > 0}
                            for name, r in sorted(self.rates.items())},
                "prefill": None if fit is None else {
                    "step_s": fit.c0, "per_token_s": fit.per_token, "per_pair_s": fit.per_pair,
                    # Tokens/s of a 256-token chunk computed after 0, 2k and 8k cached tokens.
                    "tokens_per_s": {str(ctx): _tokens_per_s(fit, ctx) for ctx in (0, 2048, 8192)}},
            }


def _tokens_per_s(fit: PrefillFit, ctx: int, n: int = 256) -> float | None:
    seconds = fit.seconds(ctx, ctx + n)
    return n / seconds if seconds > 0 else None


def step_features(requests) -> tuple[int, float]:
    """(tokens, attended pairs) of a step: ``requests`` gives (tokens computed, tokens cached
    before them) per request in it."""
    tokens, pairs = 0, 0.0
    for n, ctx in requests:
        tokens += n
        pairs += attended_pairs(n, ctx)
    return tokens, pairs


def load_share(decision: dict | None, source: str, start: int, end: int) -> float:
    """For a router: the share of recomputing tokens [start, end) that having them in ``source``
    (a tier's name) still costs, by an instance's /status ``kv_load_decision``: loading time over
    computing time, at most 1 (the instance recomputes what loads slower). 0 (a free hit, as
    before) while the instance has no estimate to go by or has the decision off."""
    try:
        if not decision or not decision["enabled"] or decision["prefill"] is None or end <= start:
            return 0.0
        prefill = decision["prefill"]
        fit = PrefillFit(0.0, float(prefill["per_token_s"]), float(prefill["per_pair_s"]))
        rate = decision["sources"].get(source, {}).get("bytes_per_s") or SEED_RATES.get(source, DEFAULT_SEED_RATE)
        load_s = (end - start) * float(decision["bytes_per_token"]) / float(rate)
        compute_s = fit.seconds(start, end)
    except (KeyError, TypeError, ValueError, AttributeError):
        return 0.0  # an instance of another release: its hits count as before
    return min(1.0, load_s / compute_s) if compute_s > 0 else 1.0
