"""The proxy's estimate of each prefill->decode path's speed (entrypoints/kv_paths.py), from the
pull totals the decode instances report, and how it weighs in the choice of a decode instance.
Across real hosts with a slow link: tests/test_multihost.py."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entrypoints import kv_paths
from entrypoints.kv_paths import TransferPaths
from entrypoints.kv_router import KVRouter
from entrypoints.proxy import Proxy

P = "tcp://10.0.0.1:14579"


def _totals(pulls: int, tokens: int, seconds: float, timeouts: int = 0) -> dict:
    return {P: {"pulls": pulls, "timeouts": timeouts, "tokens": tokens, "bytes": tokens * 100, "seconds": seconds}}


def _measured(paths: TransferPaths, url: str, seconds_per_1k: float) -> None:
    paths.observe(url, {})
    paths.observe(url, _totals(1, 1000, seconds_per_1k))


def test_a_path_is_known_from_the_pulls_after_its_first_reading():
    paths = TransferPaths()
    paths.observe("d1", _totals(5, 5000, 100.0))  # before the proxy watched: only the baseline
    paths.observe("d2", {})  # nothing pulled yet
    assert paths.excess_seconds(["d1", "d2"], P, 1000) == {"d1": 0.0, "d2": 0.0}
    paths.observe("d1", _totals(6, 6000, 100.1))  # 0.1 ms per token
    paths.observe("d2", _totals(1, 1000, 2.0))  # its first pull from P: 2 ms per token
    assert paths.excess_seconds(["d1", "d2"], P, 1000) == pytest.approx({"d1": 0.0, "d2": 1.9})
    assert paths.excess_seconds(["d1", "d2"], "tcp://other:1", 1000) == {"d1": 0.0, "d2": 0.0}
    assert [s["seconds_per_1k_tokens"] for s in paths.status()] == [0.1, 2.0]


def test_short_pulls_are_no_measure_and_the_past_fades():
    paths = TransferPaths()
    _measured(paths, "fast", 0.0)  # the free path the others are measured against
    paths.observe("d", {})
    paths.observe("d", _totals(3, 30, 0.3))  # pulls of a block or two: all fixed cost, left out
    assert paths.excess_seconds(["d", "fast"], P, 1000)["d"] == 0.0
    paths.observe("d", _totals(4, 2030, 2.3))  # then 1 ms per token over 2000 tokens
    paths.observe("d", _totals(5, 2530, 3.3))  # and 2 ms per token over 500
    assert paths.excess_seconds(["d", "fast"], P, 1000)["d"] == pytest.approx(1000 * (1.0 + 1.0) / (1000 + 500))
    for i in range(1, 20):  # the link healed: 0.1 ms per token from now on
        paths.observe("d", _totals(5 + i, 2530 + 1000 * i, 3.3 + 0.1 * i))
    assert paths.excess_seconds(["d", "fast"], P, 1000)["d"] == pytest.approx(0.1, rel=0.01)


def test_a_pull_that_timed_out_counts_with_the_time_it_took():
    paths = TransferPaths()
    _measured(paths, "fast", 0.1)
    paths.observe("cut", {})
    paths.observe("cut", _totals(1, 64, 30.0, timeouts=1))  # short, but it timed out: a measure
    assert paths.excess_seconds(["fast", "cut"], P, 64)["cut"] == pytest.approx(30.0, rel=0.01)


def test_noise_between_equal_links_is_no_difference():
    paths = TransferPaths()
    _measured(paths, "a", 1.0)
    _measured(paths, "b", 1.2)
    assert paths.excess_seconds(["a", "b"], P, 4000) == {"a": 0.0, "b": 0.0}
    _measured(paths, "c", 1.3)
    assert paths.excess_seconds(["a", "c"], P, 4000)["c"] == pytest.approx(1.2)


def test_a_restarted_decode_instance_and_garbage_do_not_confuse_it():
    paths = TransferPaths()
    paths.observe("d", _totals(1, 1000, 1.0))
    paths.observe("d", _totals(2, 2000, 2.0))
    paths.observe("d", _totals(1, 10, 0.5))  # restarted: a new baseline, no negative sample
    for garbage in ({P: {"tokens": "x"}, "q": None, 5: []}, {P: {"pulls": -1, "tokens": 5, "seconds": 1}},
                    {P: {"pulls": 9, "tokens": 9000, "seconds": float("nan")}}, None, [1]):
        paths.observe("d", garbage)
    assert paths.excess_seconds(["d"], P, 1000) == {"d": 0.0}  # alone, it is the fastest
    paths.observe("d", _totals(2, 1010, 1.5))
    _measured(paths, "e", 3.0)
    assert paths.excess_seconds(["d", "e"], P, 1000) == pytest.approx({"d": 0.0, "e": 2.0}, rel=0.01)


def test_producers_a_decode_instance_no_longer_reports_are_dropped():
    paths = TransferPaths()
    _measured(paths, "d", 1.0)
    paths.observe("d", {"tcp://other:1": _totals(1, 1, 0)[P]})
    assert [p["prefill_kv"] for p in paths.status()] == ["tcp://other:1"]


def test_a_path_not_pulled_over_for_a_while_is_forgotten(monkeypatch):
    paths = TransferPaths()
    _measured(paths, "d", 5.0)
    _measured(paths, "e", 1.0)
    assert paths.excess_seconds(["d", "e"], P, 1000) == pytest.approx({"d": 4.0, "e": 0.0})
    later = kv_paths.time.monotonic() + kv_paths.FORGET_S + 1
    monkeypatch.setattr(kv_paths.time, "monotonic", lambda: later)
    assert paths.excess_seconds(["d", "e"], P, 1000) == {"d": 0.0, "e": 0.0}


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 3), st.integers(0, 5000),
                          st.floats(0, 50), st.booleans()), max_size=30), st.integers(1, 10**6))
def test_excess_is_never_negative_and_the_fastest_known_path_is_free(readings, tokens):
    paths = TransferPaths()
    totals: dict[str, tuple[int, int, float, int]] = {}
    for url, more_pulls, more_tokens, more_seconds, timed_out in readings:
        p, t, s, o = totals.get(url, (0, 0, 0.0, 0))
        totals[url] = (p + more_pulls, t + more_tokens, s + more_seconds, o + (timed_out and more_pulls > 0))
        paths.observe(url, _totals(*totals[url]))
    excess = paths.excess_seconds(["a", "b", "c"], P, tokens)
    assert set(excess) == {"a", "b", "c"}
    assert all(v >= 0 for v in excess.values())
    assert min(excess.values()) == 0.0


def test_the_proxy_sends_a_hand_off_over_the_faster_path_unless_the_load_outweighs_it():
    proxy = Proxy(["http://p"], ["http://d1", "http://d2"], transfer_weight=10)
    _measured(proxy.paths, "http://d1", 3.0)
    _measured(proxy.paths, "http://d2", 0.5)
    offer = {"do_remote_prefill": True, "remote_kv_addr": P, "num_tokens": 400}
    extra = proxy.transfer_load(offer)
    assert extra == {"http://d1": 10.0, "http://d2": 0.0}  # 1 s slower: 10 requests
    d1, d2 = proxy.decodes
    for _ in range(4):
        assert proxy.pick(proxy.decodes, None, "hand-off", extra) is d2
    d2.in_flight = 11
    assert proxy.pick(proxy.decodes, None, "hand-off", extra) is d1
    assert proxy.transfer_load([offer, {**offer, "num_tokens": 600}]) == {"http://d1": 25.0, "http://d2": 0.0}
    assert proxy.transfer_load({**offer, "num_tokens": 10}) == {"http://d1": 0.0, "http://d2": 0.0}  # < 1 request
    assert proxy.transfer_load({"do_remote_prefill": False}) == {}
    assert proxy.transfer_load({**offer, "remote_kv_addr": None}) == {}
    assert proxy.transfer_load({**offer, "num_tokens": True}) == {}
    assert Proxy(["http://p"], ["http://d1"], transfer_weight=0).transfer_load(offer) == {}
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            Proxy(["http://p"], ["http://d1"], transfer_weight=bad)


def test_kv_aware_routing_charges_a_slow_path_only_for_what_it_would_pull():
    router = KVRouter()

    class Prompt:
        num_tokens = 1000
        by_hasher: dict = {}
    d1, d2 = Proxy([], ["http://d1", "http://d2"]).decodes
    extra = {"http://d1": 40.0, "http://d2": 0.0}  # d1 slower by 40 requests, for the whole prompt
    assert router.choose([d1, d2], Prompt(), extra)[0] is d2
    router.hasher_keys["http://d1"] = ("h", 16)  # d1 holds 60 of the prompt's blocks: 960 tokens

    class Index:
        def hit_tokens(self, hashes, block_size):
            return 60 * block_size
    router.indexes["http://d1"] = Index()
    assert router.choose([d1, d2], Prompt(), extra)[0] is d1


@pytest.mark.parametrize("local_first", [False, True], ids=["always-remote", "conditional"])
@pytest.mark.parametrize("policy", ["least-loaded", "round-robin"])
def test_idle_decode_instances_take_turns_at_hand_offs_whatever_else_a_request_chose(policy, local_first):
    """Each request also picks a prefill instance (and, with conditional disaggregation, asks a
    decode instance to serve it locally first): the hand-offs still alternate. One turn shared
    by all choices sent every hand-off to the same instance when a request made two."""
    proxy = Proxy(["http://p"], ["http://d1", "http://d2"], policy)
    handed = []
    for _ in range(6):
        if local_first:
            proxy.pick(proxy.decodes, None, "local")
        proxy.ordered(proxy.prefills, "prefill")
        handed.append(proxy.pick(proxy.decodes, None, "hand-off", {}).url)
    assert handed.count("http://d1") == handed.count("http://d2") == 3
