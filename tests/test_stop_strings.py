"""Stop strings (engine/stop_strings.py): one automaton per request finds, a character at a time,
what a naive scan of the whole text finds, however the text is cut into pieces; the detokenizer
cuts the text there, streamed or not; and the work per token does not grow with the number of
stop strings (once, 20,000 stop strings cost 4.7 ms per sequence per token, on the API server's
event loop)."""
from __future__ import annotations

import os.path
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import MAX_STOP_STRING_LEN, MAX_STOP_STRINGS, SamplingParams
from engine.stop_strings import StopStrings

# Few letters, so stop strings overlap, nest and repeat in the text; and characters past the BMP.
CHARS = st.sampled_from(list("aab") + ["c", "é", "🙂"])


def naive_first_stop(text: str, stops: list[str], report_from: int = 0) -> tuple[int, int] | None:
    """(end, length) of the stop string complete first in ``text`` (ending at or after
    ``report_from``); of those complete at the same character, the longest."""
    for end in range(max(report_from, 0) + 1, len(text) + 1):
        lengths = [len(s) for s in stops if text.endswith(s, 0, end)]
        if lengths:
            return end, max(lengths)
    return None


def _cuts(data, text: str) -> list[str]:
    points = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=400, deadline=None, derandomize=True)
@given(stops=st.lists(st.text(CHARS, min_size=1, max_size=6), min_size=1, max_size=8),
       text=st.text(CHARS, max_size=60), data=st.data())
def test_the_automaton_finds_what_a_naive_scan_finds(stops, text, data):
    """Fed in any pieces, the first few only keeping its place (min_tokens), the matcher
    reports the first stop string complete after them, as the naive scan of the whole text."""
    pieces = _cuts(data, text)
    quiet = data.draw(st.integers(0, len(pieces)))  # pieces fed before stop strings count
    report_from = sum(map(len, pieces[:quiet]))
    matcher = StopStrings(stops).matcher()
    found, offset = None, 0
    for i, piece in enumerate(pieces):
        hit = matcher.feed(piece, report=i >= quiet)
        if hit is not None:
            found = (offset + hit[0], hit[1])
            break
        offset += len(piece)
    assert found == naive_first_stop(text, stops, report_from)
    assert matcher.scanned == (found[0] if found else len(text))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(stops=st.lists(st.text(CHARS, min_size=1, max_size=5), min_size=1, max_size=4),
       texts=st.lists(st.text(CHARS, max_size=30), min_size=2, max_size=3))
def test_sequences_of_one_request_share_the_automaton_and_not_their_place(stops, texts):
    automaton = StopStrings(stops)
    matchers = [automaton.matcher() for _ in texts]
    found: list = [None] * len(texts)
    for step in range(max(map(len, texts))):  # interleaved, a character each
        for i, text in enumerate(texts):
            if found[i] is None and step < len(text):
                hit = matchers[i].feed(text[step])
                if hit is not None:
                    found[i] = (step + 1, hit[1])
    assert found == [naive_first_stop(t, stops) for t in texts]


# ---- the detokenizer ------------------------------------------------------------------------

WORDS = st.sampled_from(["the", " the", " cat", "cat", " sat", ".", "\n", " 🙂", "é", " on", "at", " mat"])


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_str(AutoTokenizer.from_pretrained(smollm2_dir)._tokenizer.to_str())


@settings(max_examples=150, deadline=None, derandomize=True)
@given(words=st.lists(WORDS, min_size=3, max_size=20), data=st.data(), streamed=st.booleans(),
       include=st.booleans())
def test_the_detokenizer_cuts_the_text_at_the_stop_string_complete_first(tokenizer, words, data, streamed, include):
    """Stop strings span token boundaries; while streaming, what went out never holds a piece
    of the stop string that ends the text; the text is the whole decode cut there."""
    text = "".join(words)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if len(ids) < 2:
        return
    whole = tokenizer.decode(ids)
    prompt = tokenizer.decode(ids[:1])
    output = whole[len(os.path.commonprefix([whole, prompt])):]
    # Stop strings cut from the output itself (they match, often across tokens), and others.
    def cut(s: str) -> st.SearchStrategy:
        return st.integers(0, max(len(s) - 1, 0)).flatmap(
            lambda a: st.integers(a + 1, min(len(s), a + 8)).map(lambda b: s[a:b]))
    stop = data.draw(st.lists(st.one_of(cut(output), st.text(CHARS, min_size=1, max_size=4)) if output
                              else st.text(CHARS, min_size=1, max_size=4), min_size=1, max_size=5))
    detok = IncrementalDetokenizer(tokenizer, ids[:1], SamplingParams(stop=stop, include_stop_str_in_output=include))
    pieces, matched = [], None
    for chunk in ([[t] for t in ids[1:]] if streamed else [ids[1:]]):
        matched = detok.update(chunk)
        if matched is not None:
            break
        pieces.append(detok.next_delta(False))
    pieces.append(detok.next_delta(True))
    hit = naive_first_stop(output, stop)
    if hit is None:
        assert matched is None and detok.text == output
    else:
        end, length = hit
        assert matched == output[end - length:end]
        assert detok.text == output[:end if include else end - length]
    assert "".join(pieces) == detok.text


# ---- cost -----------------------------------------------------------------------------------

def _bound_stops(count: int, seed: int = 0) -> list[str]:
    """Stop strings at the length bound, over two letters: the text keeps matching their
    beginnings (the failure links are exercised), and never a whole one."""
    rng = random.Random(seed)
    return ["".join(rng.choice("ab") for _ in range(MAX_STOP_STRING_LEN)) for _ in range(count)]


def test_stop_strings_are_bounded():
    SamplingParams(stop=_bound_stops(MAX_STOP_STRINGS))  # at the bound
    with pytest.raises(ValueError, match=r"^stop "):
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match=r"^stop "):
        SamplingParams(stop=["x" * (MAX_STOP_STRING_LEN + 1)])


@pytest.mark.parametrize("alphabet", ["ab", "a"])
def test_each_character_is_scanned_once_whatever_the_number_of_stop_strings(alphabet):
    """The matcher scans only the new characters (never a window of the text again), and the
    automaton's work per character (failure links followed, states made) stays within a
    constant, for one stop string or as many as allowed, each as long as allowed."""
    rng = random.Random(1)
    text = "".join(rng.choice(alphabet) for _ in range(20_000))
    steps = {}
    for count in (1, MAX_STOP_STRINGS):
        stops = [s + "c" for s in _bound_stops(count)] if alphabet == "ab" else [
            "a" * (MAX_STOP_STRING_LEN - 1 - i) + "c" for i in range(count)]  # failure chains 1023 long
        stops = [s[-MAX_STOP_STRING_LEN:] for s in stops]
        automaton = StopStrings(stops)
        matcher = automaton.matcher()
        for start in range(0, len(text), 4):  # a token of 4 characters at a time
            assert matcher.feed(text[start:start + 4]) is None
        assert matcher.scanned == len(text)
        steps[count] = automaton.steps
        assert automaton.steps <= 3 * len(text), (count, automaton.steps)
    assert steps[MAX_STOP_STRINGS] <= 2 * steps[1] + len(text), steps


def test_per_token_time_does_not_grow_with_the_number_of_stop_strings(tokenizer):
    """Measured in the same test, interleaved, best of several: a token costs about the same
    with one stop string as with as many as allowed (before the automaton: 22 times as much)."""
    words = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on"]
    rng = random.Random(0)
    ids = tokenizer.encode(" ".join(rng.choice(words) for _ in range(1500)), add_special_tokens=False).ids[:1000]

    def stops(count: int) -> list[str]:  # like the text, never in it
        return [("zz " + " ".join(rng.choice(words) for _ in range(300)))[:MAX_STOP_STRING_LEN] for _ in range(count)]

    def per_token(stop: list[str]) -> float:
        detok = IncrementalDetokenizer(tokenizer, ids[:4], SamplingParams(stop=stop, max_tokens=None))
        started = time.perf_counter()
        for token_id in ids[4:]:
            assert detok.update([token_id]) is None
        return (time.perf_counter() - started) / (len(ids) - 4)

    few, many = stops(1), stops(MAX_STOP_STRINGS)
    best = {1: float("inf"), MAX_STOP_STRINGS: float("inf")}
    for _ in range(7):
        best[1] = min(best[1], per_token(few))
        best[MAX_STOP_STRINGS] = min(best[MAX_STOP_STRINGS], per_token(many))
    assert best[MAX_STOP_STRINGS] < 4 * best[1], {k: f"{v * 1e6:.1f} us" for k, v in best.items()}
