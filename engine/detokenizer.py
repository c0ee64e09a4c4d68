"""Incremental detokenization and stop strings.

Text is produced with tokenizers' DecodeStream, primed with the tail of the prompt so that
word-initial spaces come out as they would inside the full text. Invariant: the deltas
handed out concatenate to exactly the final text, which is the whole text's decode after the
prompt's complete characters (a character the prompt's ids end inside of is output text). While a request runs, the last
``len(longest stop string) - 1`` characters are held back, since they may turn out to be the
start of a stop string that must not appear in the output.
"""
from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from engine.sampling_params import SamplingParams

_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        # (_skip: prompt characters the stream will hand out with the first output character.)
        self.stream, self._skip = _primed_stream(tokenizer, prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:],
                                                 params.skip_special_tokens)
        self.stop = params.stop
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
            if piece and self._skip:
                piece, self._skip = piece[self._skip:], max(0, self._skip - len(piece))
            if piece:
                self.text += piece
            if self.stop and self.num_tokens > self.min_tokens:
                matched = self._check_stop(before)
                if matched is not None:
                    return matched
        return None

    def _check_stop(self, new_from: int) -> str | None:
        # Only a window that overlaps the new characters can hold a new match.
        for stop in self.stop:
            start = max(0, new_from - len(stop) + 1)
            index = self.text.find(stop, start)
            if index != -1:
                self.text = self.text[:index + len(stop) if self.include_stop else index]
                return stop
        return None

    @property
    def num_sent_chars(self) -> int:
        return self._sent

    @property
    def sent_text(self) -> str:
        return self.text[:self._sent]

    def next_delta(self, finished: bool) -> str:
        end = len(self.text) if finished else max(self._sent, len(self.text) - self.hold_back)
        delta = self.text[self._sent:end]
        self._sent = end
        return delta


def _primed_stream(tokenizer: Tokenizer, tail: list[int], skip_special_tokens: bool) -> tuple[DecodeStream, int]:
    """A DecodeStream that has seen the prompt's tail, and how many characters of the prompt
    its first text will still carry. Primed with ids that end inside a UTF-8 character,
    DecodeStream keeps no prefix and its first step returns the prompt's text too; so it is
    primed with the tail up to its last complete token, and the tokens after that (a
    character the output will finish) are stepped through. Their complete characters (a space
    before the split character) are prompt text, handed out with that character: skipped."""
    def text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    complete = len(tail)
    while complete > 0 and text(tail[:complete]).endswith("\ufffd"):
        complete -= 1
    stream = DecodeStream(ids=tail[:complete], skip_special_tokens=skip_special_tokens)
    if complete == len(tail):
        return stream, 0
    for token_id in tail[complete:]:
        stream.step(tokenizer, token_id)  # incomplete: nothing comes out yet
    return stream, len(text(tail).rstrip("\ufffd")) - len(text(tail[:complete]))
