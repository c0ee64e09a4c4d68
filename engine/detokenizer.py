"""Incremental detokenization and stop strings.

Text is produced with tokenizers' DecodeStream, primed with the tail of the prompt so that
word-initial spaces come out as they would inside the full text. Invariant: the deltas
handed out concatenate to exactly the final text, which is the whole text's decode after what
it shares with the prompt's own decode (a character the prompt's ids end inside of and the
output completes is output text; bytes no output completes stay the prompt's, as a
replacement character). While a request runs, the last
``len(longest stop string) - 1`` characters are held back, since they may turn out to be the
start of a stop string that must not appear in the output. Stop strings are matched by one
automaton per request (engine/stop_strings.py) that scans each character of the text once,
whatever their number.
"""
from __future__ import annotations

import os.path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from engine.sampling_params import SamplingParams
from engine.stop_strings import StopStrings

_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams,
                 stop_strings: StopStrings | None = None) -> None:
        """``stop_strings``: the request's automaton, shared by its sequences (made here from
        ``params.stop`` when not given)."""
        self.tokenizer = tokenizer
        tail = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        self.skip_special_tokens = params.skip_special_tokens
        self.stream, complete = _primed_stream(tokenizer, tail, params.skip_special_tokens)
        # The stream's text so far ends after the ids in _rendered (the last few); the output ids
        # in _pending have not shown in it yet (bytes of a character still incomplete). A
        # prompt whose ids end in such bytes: the stream's first text starts with them, and
        # whether they are the prompt's (nothing completes them) or the output's (its first
        # token finishes the character) shows only then.
        self._rendered, self._pending = tail, []
        self._prompt_undecided = complete < len(tail)
        self._ended = False  # by a stop string, or flushed at the finish
        self.stop = params.stop
        if stop_strings is None and self.stop:
            stop_strings = StopStrings(self.stop)
        self._stops = stop_strings.matcher() if self.stop else None
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.num_tokens = 0
        self._sent = 0  # characters of text already handed out

    def update(self, token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string that ended the text, if one did."""
        for token_id in token_ids:
            self.num_tokens += 1
            before = len(self.text)
            piece = self.stream.step(self.tokenizer, token_id)
            self._pending.append(token_id)
            if piece:
                if self._prompt_undecided:  # the stream's piece would start inside the prompt's text
                    piece, self._prompt_undecided = self._pending_text(), False
                self._rendered = (self._rendered + self._pending)[-_PROMPT_CONTEXT_TOKENS:]
                self._pending = []
                self.text += piece
                if self._stops is not None:
                    matched = self._check_stop(piece, before)
                    if matched is not None:
                        return matched
        return None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _pending_text(self) -> str:
        """What the pending ids add to the whole text's decode: past what the decode with them
        shares with the decode without them."""
        before, after = self._decode(self._rendered), self._decode(self._rendered + self._pending)
        return after[len(os.path.commonprefix([after, before])):]

    def _check_stop(self, piece: str, new_from: int) -> str | None:
        """Scan the new characters (``piece``, from ``new_from`` in the text) for the stop string
        complete first; before min_tokens tokens, the scan only keeps its place."""
        found = self._stops.feed(piece, report=self.num_tokens > self.min_tokens)
        if found is None:
            return None
        end, length = found
        index = new_from + end - length
        stop = self.text[index:index + length]
        self.text = self.text[:index + length if self.include_stop else index]
        self._ended = True
        return stop

    @property
    def num_sent_chars(self) -> int:
        return self._sent

    @property
    def sent_text(self) -> str:
        return self.text[:self._sent]

    def next_delta(self, finished: bool) -> str:
        if finished and not self._ended:  # bytes no token completed show as the whole decode has them
            self._ended = True
            if self._pending:
                self.text += self._pending_text()
        end = len(self.text) if finished else max(self._sent, len(self.text) - self.hold_back)
        delta = self.text[self._sent:end]
        self._sent = end
        return delta


def _primed_stream(tokenizer: Tokenizer, tail: list[int], skip_special_tokens: bool) -> tuple[DecodeStream, int]:
    """A DecodeStream that has seen the prompt's tail, and how many of the tail's ids it keeps
    as its prefix. Primed with ids that end inside a UTF-8 character, DecodeStream keeps no
    prefix and its first step returns the prompt's text too; so it is primed with the tail up
    to its last complete token, and the tokens after that are stepped through (their text comes
    out with the first output text, where IncrementalDetokenizer cuts the prompt's part off)."""
    def text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    complete = len(tail)
    while complete > 0 and text(tail[:complete]).endswith("\ufffd"):
        complete -= 1
    stream = DecodeStream(ids=tail[:complete], skip_special_tokens=skip_special_tokens)
    for token_id in tail[complete:]:
        stream.step(tokenizer, token_id)  # incomplete: nothing comes out yet
    return stream, complete
