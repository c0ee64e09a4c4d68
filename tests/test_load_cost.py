"""Load or recompute (engine/kv_transfer/load_cost.py): the rate estimates, the prefill cost fit
and the planner, with fakes; then the tiered connector's scheduler half deciding on a real
lookup over real CPU and disk tiers. End to end (real engines, a rate-limited Redis host) is in
tests/test_load_decision_served.py."""
from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv_transfer.load_cost import (
    SEED_RATES,
    LoadOption,
    LoadPlanner,
    PrefillCost,
    PrefillFit,
    SourceRate,
    attended_pairs,
    step_features,
)
from tests.server_utils import wait_for


# ---- rates ---------------------------------------------------------------------------------
def test_a_source_is_its_seed_until_measured():
    rate = SourceRate("redis")
    assert rate.bytes_per_s == SEED_RATES["redis"] and rate.samples == 0
    rate.observe(0, 1.0)  # nothing moved: no sample
    rate.observe(100, 0.0)
    assert rate.samples == 0
    rate.observe(1000, 1.0)
    assert rate.bytes_per_s == pytest.approx(1000.0)


@given(st.floats(1e3, 1e10), st.lists(st.integers(1, 10**8), min_size=1, max_size=40))
def test_a_steady_source_is_measured_at_its_rate(bytes_per_s, sizes):
    rate = SourceRate("disk")
    for n in sizes:
        rate.observe(n, n / bytes_per_s)
    assert rate.bytes_per_s == pytest.approx(bytes_per_s, rel=1e-6)


def test_the_recent_past_outweighs_the_old():
    rate = SourceRate("redis")
    for _ in range(20):
        rate.observe(10**6, 0.001)  # 1 GB/s
    for _ in range(10):
        rate.observe(10**6, 1.0)  # then the link slows to 1 MB/s
    assert rate.bytes_per_s < 1.1e6


# ---- prefill -------------------------------------------------------------------------------
def _steps(fit: PrefillFit, noise: float = 0.0, seed: int = 0):
    """Steps of a fake engine whose step time follows ``fit``: prefills of various lengths after
    various cached prefixes, and decode batches."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(60):
        if i % 3:
            reqs = [(1, int(torch.randint(10, 4000, (1,), generator=gen))) for _ in range(1 + i % 8)]
        else:
            reqs = [(int(torch.randint(16, 2048, (1,), generator=gen)), int(torch.randint(0, 4000, (1,), generator=gen)))]
        tokens, pairs = step_features(reqs)
        seconds = fit.c0 + fit.per_token * tokens + fit.per_pair * pairs
        out.append((tokens, pairs, seconds * (1 + noise * float(torch.rand(1, generator=gen) - 0.5))))
    return out


@settings(deadline=None, max_examples=40)
@given(st.floats(1e-4, 5e-2), st.floats(1e-6, 1e-3), st.floats(1e-10, 1e-7))
def test_the_fit_recovers_a_linear_plus_quadratic_cost(c0, per_token, per_pair):
    true = PrefillFit(c0, per_token, per_pair)
    cost = PrefillCost()
    for step in _steps(true):
        cost.observe(*step)
    got = cost.fit
    for start, end in [(0, 256), (2048, 2304), (0, 4000), (6000, 8000)]:
        assert got.seconds(start, end) == pytest.approx(true.seconds(start, end), rel=1e-3)


@settings(deadline=None, max_examples=30)
@given(st.integers(0, 2**31), st.floats(0.0, 1.0))
def test_the_fit_never_goes_negative_and_grows_with_context(seed, noise):
    cost = PrefillCost()
    for step in _steps(PrefillFit(0.01, 2e-4, 3e-9), noise, seed):
        cost.observe(*step)
    fit = cost.fit
    assert min(fit.c0, fit.per_token, fit.per_pair) >= 0
    assert fit.seconds(4096, 4352) >= fit.seconds(0, 256) > 0


def test_the_fit_is_made_of_prefill_steps_alone():
    """Decode steps (memory-bound attention) never enter it: no fit from decodes alone, and
    decodes after the prefills do not move it."""
    cost = PrefillCost()
    for _ in range(50):
        cost.observe(4, attended_pairs(1, 100) * 4, 0.01)  # decode steps only
    assert cost.fit is None
    for n in (300, 200, 500, 100):
        cost.observe(n, attended_pairs(n, 0), 1e-3 * n)
    fit = cost.fit
    assert fit is not None
    for _ in range(300):  # a window's worth of decodes, far slower per token
        cost.observe(4, attended_pairs(1, 4000) * 4, 0.5)
    assert cost.fit == fit


def test_attended_pairs_are_the_causal_count():
    assert attended_pairs(3, 0) == 1 + 2 + 3
    assert attended_pairs(2, 10) == 11 + 12
    assert step_features([(3, 0), (1, 99)]) == (4, 6 + 100)


# ---- the planner ---------------------------------------------------------------------------
def _planner(per_token: float = 1e-3, per_pair: float = 0.0, **rates: float) -> LoadPlanner:
    planner = LoadPlanner()
    planner.prefill.fit = PrefillFit(0.0, per_token, per_pair)
    for source, bytes_per_s in rates.items():
        planner.observe_transfer(source, int(bytes_per_s), 1.0)
    return planner


def _options(sources: list[str], chunk_tokens: int = 256, chunk_bytes: int = 10**6) -> list[LoadOption]:
    return [LoadOption((c + 1) * chunk_tokens, chunk_bytes, s) for c, s in enumerate(sources)]


def test_a_source_never_read_from_is_loaded_and_a_declined_one_retried_now_and_then():
    """An unmeasured source is loaded (which measures it): its seed rate would otherwise decide
    for good, since what is never loaded is never timed. A measured slow one is declined, but
    every EXPLORE_EVERY-th decline loads anyway, so a link that got faster is seen again."""
    from engine.kv_transfer.load_cost import EXPLORE_EVERY
    planner = _planner(per_token=1e-6)  # recompute is nearly free
    assert planner.plan(0, 2048, _options(["redis"] * 4)) == 4
    planner.observe_transfer("redis", 10**6, 10.0)  # 100 kB/s
    choices = [planner.plan(0, 2048, _options(["redis"] * 4)) for _ in range(2 * EXPLORE_EVERY)]
    assert choices.count(4) == 2 and choices.count(0) == 2 * EXPLORE_EVERY - 2
    assert choices[EXPLORE_EVERY - 1] == 4


def _connector(planner, stores):
    """The tiered connector's two halves over ``stores`` (4-token blocks, 16-token chunks) and
    ``step(output=None)``: one scheduler step's metadata through the worker and back."""
    from engine.kv_transfer.tiered import TieredConnectorScheduler
    from engine.kv_transfer.tiered_worker import TieredConnectorWorker, TieredStore
    from engine.outputs import CachedRequestData, SchedulerOutput
    from tests.test_kv_store import FMT
    sched = TieredConnectorScheduler(block_size=4, chunk_tokens=16, planner=planner, chunk_bytes=FMT.nbytes)
    worker = TieredConnectorWorker(TieredStore(stores))
    worker.register_kv_caches(torch.zeros(2, 2, 64, 4, 2, 8))

    def step(output=None):
        meta = sched.build_connector_meta(output or SchedulerOutput([], CachedRequestData(), {}, 0, set()))
        worker.start_load_kv(meta)
        sched.update_connector_output(worker.get_finished())
        return meta
    return sched, worker, step


def test_chunks_recomputed_instead_of_loaded_are_not_saved_again(tmp_path):
    """A decision to recompute chunks a tier holds must not send them back to it (over the link
    just judged too slow to read them): the step that computes them saves nothing already there."""
    from engine.kv_transfer.stores.disk import DiskStore
    from engine.outputs import CachedRequestData, SchedulerOutput
    from tests.scheduler_utils import make_request
    from tests.test_kv_store import FMT, _chunk

    disk = DiskStore(str(tmp_path / "kv"), 2**24, FMT)
    planner = _planner(per_token=1e-3)
    planner.observe_transfer("disk", FMT.nbytes, 10.0)
    sched, worker, step = _connector(planner, [disk])

    try:
        a = make_request("a", 65)
        keys = [a.block_hashes[(c + 1) * 4 - 1].hex() for c in range(4)]
        for c, key in enumerate(keys):
            disk.put(key, _chunk(c))
        assert sched.get_num_new_matched_tokens(a, 0) is None
        step()
        deadline = time.monotonic() + 10
        while (match := sched.get_num_new_matched_tokens(a, 0)) is None and time.monotonic() < deadline:
            step()
            time.sleep(0.01)
        assert match == (0, False)  # all recomputed
        sched.update_state_after_alloc(a, list(range(17)), 0, 0)
        sched.block_ids_of = lambda req_id: list(range(17))
        meta = step(SchedulerOutput([], CachedRequestData(), {"a": 64}, 64, set()))
        assert not [save.key for save in meta.saves if save.key in keys]
    finally:
        worker.shutdown()


def test_a_fast_tier_is_loaded_and_a_slow_one_recomputed():
    # 256 tokens compute in 0.256 s; a 1 MB chunk loads in 1 ms from cpu, in 10 s from redis.
    planner = _planner(cpu=1e9, redis=1e5)
    assert planner.plan(0, 1100, _options(["cpu"] * 4)) == 4
    assert planner.plan(0, 1100, _options(["redis"] * 4)) == 0
    # The first part from memory, the rest computed: partial.
    assert planner.plan(0, 1100, _options(["cpu", "cpu", "redis", "redis"])) == 2


def test_the_quadratic_term_makes_a_long_prefix_worth_loading():
    # Each chunk loads in 0.5 s and its tokens compute in 0.256 s, plus attention over the
    # context before them. A short prefix computes faster than it loads; a long one does not.
    planner = _planner(per_pair=3e-7, redis=2e6)
    assert planner.plan(0, 1100, _options(["redis"] * 4)) == 0
    assert planner.plan(0, 8200, _options(["redis"] * 32)) == 32
    # Without attention's cost, the long one too is recomputed.
    assert _planner(redis=2e6).plan(0, 8200, _options(["redis"] * 32)) == 0


def test_off_or_unmeasured_loads_everything():
    assert LoadPlanner().plan(0, 1100, _options(["redis"] * 4)) == 4  # no prefill fit yet
    planner = _planner(redis=1.0)
    planner.always_load = True
    assert planner.plan(0, 1100, _options(["redis"] * 4)) == 4


@settings(deadline=None, max_examples=200)
@given(st.lists(st.sampled_from(["cpu", "disk", "redis"]), min_size=1, max_size=8),
       st.floats(1e4, 1e10), st.floats(1e4, 1e10), st.floats(1e4, 1e10),
       st.floats(1e-6, 1e-2), st.floats(0, 1e-6), st.integers(0, 255), st.integers(1, 500))
def test_the_plan_is_the_fastest_prefix_of_the_options(sources, cpu, disk, redis, per_token, per_pair,
                                                       computed, rest):
    planner = _planner(per_token, per_pair, cpu=cpu, disk=disk, redis=redis)
    options = _options(sources)
    num_tokens = options[-1].end_token + rest

    def expected_s(k: int) -> float:
        load = sum(o.nbytes / planner.rate(o.source).bytes_per_s for o in options[:k])
        return load + planner.prefill.fit.seconds(options[k - 1].end_token if k else computed, num_tokens)

    chosen = planner.plan(computed, num_tokens, options)
    best = min(expected_s(k) for k in range(len(options) + 1))
    assert expected_s(chosen) <= best * (1 + 1e-9)
    assert all(expected_s(k) > expected_s(chosen) * (1 + 1e-9) or k <= chosen for k in range(len(options) + 1))


def test_decisions_are_counted_in_tokens():
    planner = _planner(cpu=1e9, redis=1e5)
    options = _options(["cpu", "cpu", "redis", "redis"])
    planner.count(0, options, planner.plan(0, 1100, options))
    planner.count(0, options, 4)
    planner.count(0, options, 0)
    snap = planner.snapshot()
    assert snap["decisions"] == {"load": 1, "partial": 1, "recompute": 1}
    assert snap["tokens_loaded"] == 512 + 1024 and snap["tokens_recomputed"] == 512 + 1024
    assert snap["sources"]["redis"] == {"bytes_per_s": pytest.approx(1e5), "measured": True}
    assert snap["prefill"]["tokens_per_s"]["0"] == pytest.approx(1000.0)


# ---- the tiered connector deciding on real tiers ---------------------------------------------
def test_the_connector_loads_the_cpu_part_and_recomputes_the_disk_part(tmp_path):
    """Chunks 0-1 in the CPU tier, 2-3 on disk only. With disk measured slow the scheduler half
    asks for the first two chunks only; the worker loads exactly those."""
    from engine.kv_transfer.stores.cpu import CPUStore
    from engine.kv_transfer.stores.disk import DiskStore
    from tests.scheduler_utils import make_request
    from tests.test_kv_store import FMT, _chunk

    cpu, disk = CPUStore(2**24, FMT), DiskStore(str(tmp_path / "kv"), 2**24, FMT)
    planner = _planner(per_token=1e-3)  # 16 tokens (a chunk) compute in 16 ms
    sched, worker, step = _connector(planner, [cpu, disk])

    try:
        a = make_request("a", 65)
        keys = [a.block_hashes[(c + 1) * 4 - 1].hex() for c in range(4)]
        for c, key in enumerate(keys):
            (cpu if c < 2 else disk).put(key, _chunk(c))
        planner.observe_transfer("disk", FMT.nbytes, 10.0)  # a chunk takes 10 s from disk
        planner.observe_transfer("cpu", FMT.nbytes, 1e-4)  # and 0.1 ms from memory
        assert sched.get_num_new_matched_tokens(a, 0) is None
        step()
        deadline = time.monotonic() + 10
        while (match := sched.get_num_new_matched_tokens(a, 0)) is None and time.monotonic() < deadline:
            step()
            time.sleep(0.01)
        assert match == (32, True)  # 2 chunks of 16 tokens: the disk ones are recomputed
        sched.update_state_after_alloc(a, list(range(17)), 0, 32)
        meta = step()
        assert [load.req_id for load in meta.loads] == ["a"]
        assert [c.key for c in meta.loads[0].chunks] == keys[:2]
        wait_for(lambda: "a" in worker.loads.take()[0])
        assert disk.stats.hits == 0 and cpu.stats.hits == 2
        snap = planner.snapshot()
        assert snap["decisions"]["partial"] == 1 and snap["tokens_loaded"] == 32 and snap["tokens_recomputed"] == 32
        # The loads were timed: the CPU tier is measured now.
        step()
        assert planner.rate("cpu").samples == 3
        sched.transfer_done("a")
        sched.request_finished(a, [])
    finally:
        worker.shutdown()


# ---- the proxy weighs tier hits by the same estimate -----------------------------------------
def _decision(planner: LoadPlanner, bytes_per_token: float) -> dict:
    planner.bytes_per_token = bytes_per_token
    return planner.snapshot()


def test_load_share_is_load_time_over_compute_time():
    from engine.kv_transfer.load_cost import load_share
    decision = _decision(_planner(per_token=1e-3, disk=1e6), 1000.0)  # a token: 1 ms to compute or to load
    assert load_share(decision, "disk", 0, 16) == pytest.approx(1.0)
    decision = _decision(_planner(per_token=1e-3, disk=4e6), 1000.0)
    assert load_share(decision, "disk", 0, 16) == pytest.approx(0.25)
    decision = _decision(_planner(per_token=1e-3, disk=1e3), 1000.0)
    assert load_share(decision, "disk", 0, 16) == 1.0  # slower than computing: it is computed
    # No estimate (an older instance, the decision off, no prefill measured yet): a free hit.
    assert load_share(None, "disk", 0, 16) == load_share({"enabled": True}, "disk", 0, 16) == 0.0
    off = _decision(_planner(per_token=1e-3, disk=1e3), 1000.0)
    off["enabled"] = False
    assert load_share(off, "disk", 0, 16) == 0.0


def test_the_router_prefers_a_pool_hit_to_a_tier_hit_that_loads_slower_than_it_computes():
    from engine.kv_events import MEDIUM_DISK
    from entrypoints.kv_router import InstanceIndex, KVRouter

    class Upstream:
        def __init__(self, url: str) -> None:
            self.url, self.in_flight = url, 0

    class Prompt:
        num_tokens = 100 * 16
        by_hasher = {("h", 16): [bytes([i]) * 32 for i in range(100)]}

    router = KVRouter()
    pool, tier = Upstream("http://pool"), Upstream("http://tier")
    for up in (pool, tier):
        router.indexes[up.url] = InstanceIndex(up.url)
        router.hasher_keys[up.url] = ("h", 16)
    router.indexes[pool.url].hashes.update(Prompt.by_hasher[("h", 16)][:60])  # 60 blocks in its pool
    router.indexes[tier.url].tiers[MEDIUM_DISK] = set(Prompt.by_hasher[("h", 16)][:90])  # 90 on its disk
    # Without an estimate the tier's 90 blocks count in full: it wins.
    assert router.choose([tier, pool], Prompt())[0] is tier
    # Its disk measured slower than its prefill: its blocks are as good as uncached.
    router.observe_load_decision(tier.url, _decision(_planner(per_token=1e-3, disk=1e3), 1000.0))
    assert router.indexes[tier.url].prefix_media(Prompt.by_hasher[("h", 16)])[:1] == [MEDIUM_DISK]
    assert router.choose([tier, pool], Prompt()) == (pool, 60 * 16)
    # Measured fast: the tier wins again.
    router.observe_load_decision(tier.url, _decision(_planner(per_token=1e-3, disk=1e9), 1000.0))
    best, hit = router.choose([tier, pool], Prompt())
    assert best is tier and hit == pytest.approx(90 * 16, abs=2)
