"""Incremental detokenization against the whole-text decode (issue 27, item 1): for any text,
a prompt cut after any of its token ids (inside a UTF-8 character too), streamed one token at a
time or in one piece, the output text is the whole text's decode after what it shares with the
prompt's decode — never a piece of the prompt; and the same for arbitrary token ids, whose bytes
may be no UTF-8 at all (the prompt's replacement characters stay the prompt's)."""
from __future__ import annotations

import os.path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams

# Multi-byte characters are the point: emoji, CJK, accents, symbols (no U+FFFD itself, which the
# oracle uses to find where the prompt's complete characters end).
ALPHABET = st.one_of(st.sampled_from(list(" abcxyz.,\n")), st.sampled_from(list("éü☃日本語🙂🤯🦜ß∑")),
                     st.characters(min_codepoint=0x80, max_codepoint=0x1FAFF, exclude_categories=("Cs", "Cc"),
                                   exclude_characters="\ufffd"))


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_str(AutoTokenizer.from_pretrained(smollm2_dir)._tokenizer.to_str())


def expected_output(tokenizer: Tokenizer, ids: list[int], cut: int) -> str:
    whole, prompt = tokenizer.decode(ids), tokenizer.decode(ids[:cut])
    return whole[len(os.path.commonprefix([whole, prompt])):]


def assert_detokenizes_as_the_whole(tokenizer: Tokenizer, ids: list[int], cut: int, streamed: bool) -> None:
    """ids[:cut] the prompt, the rest output, one token at a time or in one piece."""
    detok = IncrementalDetokenizer(tokenizer, ids[:cut], SamplingParams())
    pieces = []
    for chunk in ([[t] for t in ids[cut:]] if streamed else [ids[cut:]]):
        detok.update(chunk)
        pieces.append(detok.next_delta(False))
    pieces.append(detok.next_delta(True))
    assert "".join(pieces) == detok.text == expected_output(tokenizer, ids, cut)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=st.text(ALPHABET, min_size=2, max_size=24), data=st.data(), streamed=st.booleans())
def test_output_text_is_the_whole_decode_after_the_prompt(tokenizer, text, data, streamed):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if len(ids) < 2:
        return
    cut = data.draw(st.integers(1, len(ids) - 1))
    assert_detokenizes_as_the_whole(tokenizer, ids, cut, streamed)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(ids=st.lists(st.one_of(st.integers(17, 300), st.integers(17, 49151)), min_size=2, max_size=16),
       data=st.data(), streamed=st.booleans())
def test_any_token_ids_give_the_whole_decode_after_the_prompt(tokenizer, ids, data, streamed):
    """Byte tokens (ids below ~300) make invalid UTF-8 as often as partial characters."""
    cut = data.draw(st.integers(1, len(ids) - 1))
    assert_detokenizes_as_the_whole(tokenizer, ids, cut, streamed)


def test_a_prompt_of_invalid_bytes_stays_out_of_the_output(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [218, 218, 218], SamplingParams())  # "\U00040000" encodes to these
    detok.update([41572])
    assert detok.text == " blat"  # it answered "\ufffd\ufffd\ufffd blat" (tests/test_differential.py found it)


def test_a_prompt_cut_inside_an_emoji_is_not_repeated(tokenizer):
    ids = tokenizer.encode("Hello 🤯🦜 world", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer, ids[:2], SamplingParams())  # "Hello" + the emoji's first byte
    detok.update(ids[2:])
    assert detok.text == "🤯🦜 world"  # it answered "Hello 🤯🦜 world"
