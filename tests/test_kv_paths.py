"""The proxy's estimate of each prefill->decode path's speed (entrypoints/kv_paths.py), from the
pull totals the decode instances report, and how it weighs in the choice of a decode instance.
Across real hosts with a slow link: tests/test_multihost.py."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entrypoints import kv_paths
from entrypoints.kv_paths import TransferPaths
from entrypoints.proxy import Proxy

P = "tcp://10.0.0.1:14579"


def _totals(tokens: int, seconds: float) -> dict:
    return {P: {"pulls": 1, "tokens": tokens, "bytes": tokens * 100, "seconds": seconds}}


def test_a_path_is_known_from_the_pulls_after_its_first_reading():
    paths = TransferPaths()
    paths.observe("d1", _totals(5000, 100.0))  # before the proxy watched: only the baseline
    paths.observe("d2", {})  # nothing pulled yet
    assert paths.excess_seconds(["d1", "d2"], P, 1000) == {"d1": 0.0, "d2": 0.0}
    paths.observe("d1", _totals(6000, 100.1))  # 0.1 ms per token
    paths.observe("d2", _totals(1000, 2.0))  # its first pull from P: 2 ms per token
    assert paths.excess_seconds(["d1", "d2"], P, 1000) == pytest.approx({"d1": 0.0, "d2": 1.9})
    assert paths.excess_seconds(["d1", "d2"], "tcp://other:1", 1000) == {"d1": 0.0, "d2": 0.0}
    assert [s["seconds_per_1k_tokens"] for s in paths.status()] == [0.1, 2.0]


def test_a_long_pull_weighs_more_than_a_short_one_and_the_past_fades():
    paths = TransferPaths()
    paths.observe("fast", _totals(0, 0.0))
    paths.observe("fast", _totals(1000, 0.0))  # the free path the others are measured against
    paths.observe("d", _totals(0, 0.0))
    paths.observe("d", _totals(10, 0.05))  # a short pull: its fixed cost looks like 5 ms per token
    paths.observe("d", _totals(2010, 2.05))  # then 1 ms per token over 2000 tokens
    assert paths.excess_seconds(["d", "fast"], P, 1000)["d"] == pytest.approx(1000 * (0.025 + 2.0) / (5 + 2000))
    for i in range(1, 20):  # the link healed: 0.1 ms per token from now on
        paths.observe("d", _totals(2010 + 1000 * i, 2.05 + 0.1 * i))
    assert paths.excess_seconds(["d", "fast"], P, 1000)["d"] == pytest.approx(0.1, rel=0.01)


def test_a_restarted_decode_instance_and_garbage_do_not_confuse_it():
    paths = TransferPaths()
    paths.observe("d", _totals(1000, 1.0))
    paths.observe("d", _totals(2000, 2.0))
    paths.observe("d", _totals(10, 0.5))  # restarted: a new baseline, no negative sample
    paths.observe("d", {P: {"tokens": "x"}, "q": None, 5: []})
    paths.observe("d", None)
    assert paths.excess_seconds(["d"], P, 1000) == {"d": 0.0}  # alone, it is the fastest
    paths.observe("d", _totals(1010, 1.5))
    paths.observe("e", _totals(0, 0.0))
    paths.observe("e", _totals(1000, 3.0))
    assert paths.excess_seconds(["d", "e"], P, 1000) == pytest.approx({"d": 0.0, "e": 2.0}, rel=0.01)


def test_a_path_not_pulled_over_for_a_while_is_forgotten(monkeypatch):
    paths = TransferPaths()
    paths.observe("d", _totals(0, 0.0))
    paths.observe("d", _totals(1000, 5.0))
    paths.observe("e", _totals(0, 0.0))
    paths.observe("e", _totals(1000, 1.0))
    assert paths.excess_seconds(["d", "e"], P, 1000) == pytest.approx({"d": 4.0, "e": 0.0})
    later = kv_paths.time.monotonic() + kv_paths.FORGET_S + 1
    monkeypatch.setattr(kv_paths.time, "monotonic", lambda: later)
    assert paths.excess_seconds(["d", "e"], P, 1000) == {"d": 0.0, "e": 0.0}


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 5000), st.floats(0, 50)),
                max_size=30), st.integers(1, 10**6))
def test_excess_is_never_negative_and_the_fastest_known_path_is_free(readings, tokens):
    paths = TransferPaths()
    totals: dict[str, tuple[int, float]] = {}
    for url, more_tokens, more_seconds in readings:
        t, s = totals.get(url, (0, 0.0))
        totals[url] = (t + more_tokens, s + more_seconds)
        paths.observe(url, _totals(*totals[url]))
    excess = paths.excess_seconds(["a", "b", "c"], P, tokens)
    assert set(excess) == {"a", "b", "c"}
    assert all(v >= 0 for v in excess.values())
    assert min(excess.values()) == 0.0


def test_the_proxy_sends_a_hand_off_over_the_faster_path_unless_the_load_outweighs_it():
    proxy = Proxy(["http://p"], ["http://d1", "http://d2"], transfer_weight=10)
    for url, seconds in (("http://d1", 3.0), ("http://d2", 0.5)):  # 1000 tokens each
        proxy.paths.observe(url, _totals(0, 0.0))
        proxy.paths.observe(url, _totals(1000, seconds))
    offer = {"do_remote_prefill": True, "remote_kv_addr": P, "num_tokens": 400}
    extra = proxy.transfer_load(offer)
    assert extra == pytest.approx({"http://d1": 10.0, "http://d2": 0.0})  # 1 s slower: 10 requests
    d1, d2 = proxy.decodes
    for _ in range(4):
        assert proxy.pick(proxy.decodes, None, "hand-off", extra) is d2
    d2.in_flight = 11
    assert proxy.pick(proxy.decodes, None, "hand-off", extra) is d1
    assert proxy.transfer_load([offer, {**offer, "num_tokens": 600}]) == pytest.approx(
        {"http://d1": 25.0, "http://d2": 0.0})  # a list of prompts: all of its tokens
    assert proxy.transfer_load({"do_remote_prefill": False}) == {}
    assert proxy.transfer_load({**offer, "remote_kv_addr": None}) == {}
    assert Proxy(["http://p"], ["http://d1"], transfer_weight=0).transfer_load(offer) == {}


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
