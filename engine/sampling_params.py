"""Per-request sampling parameters, named and defaulted like vLLM's.

Every field is checked in `__post_init__`; a bad value raises `ValueError` whose message
starts with the field name, so the API server can turn it into a 400 with `param` set.
"""

import dataclasses
import math
import reprlib
from dataclasses import dataclass
from enum import IntEnum

from engine.structured_output import StructuredOutputsParams

MAX_LOGPROBS = 20
# Stop strings are matched in the front end, on the API server's event loop: at most this many
# per request, each of at most this many characters (a request over either is refused, as a
# 400 naming `stop` on the API). 64 x 1024 is far past what clients send (OpenAI's API takes 4).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 1024
MAX_INT = 2**63 - 1  # every int crosses process boundaries as a signed 64-bit msgpack int
# Temperatures below this are treated as 0 (greedy): dividing logits by them would overflow.
GREEDY_EPS = 1e-5
# Bounds that keep every processed logit finite in float32 (a penalty of 1e-300 is 0 there, and
# a logit divided by it inf): a request that would leave them is refused, naming the field. (A
# non-finite row that happens anyway, an fp16 overflow in the model, fails its request alone:
# engine/worker/sampler.py.)
MAX_TEMPERATURE = 1e6
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-6, 1e6


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `max_tokens=True` is a client bug, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, minimum: int) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > MAX_INT:
        raise ValueError(f"{name} must be <= {MAX_INT}, got {value}")
    return value


def _check_float(name: str, value: object) -> float:
    if not (_is_int(value) or isinstance(value, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1 on input) means off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None  # always list[str] after __post_init__
    stop_token_ids: list[int] | None = None  # always list[int] after __post_init__
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    logprobs: int | None = None  # None: off; 0: only the sampled token's logprob
    # None: off; k: each prompt token's logprob (after the first) and the top k at its position,
    # from the raw logits. The prompt is then computed here whole (no prefix or tier hit).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # The output follows a JSON schema, regex, choice or grammar (engine/structured_output.py).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.n = _check_int("n", self.n, 1)

        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if self.temperature > MAX_TEMPERATURE:
            raise ValueError(f"temperature must be at most {MAX_TEMPERATURE:g}, got {self.temperature}")
        self.top_p = _check_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k):
            raise ValueError(f"top_k must be an int, got {type(self.top_k).__name__} {self.top_k!r}")
        if not -1 <= self.top_k <= MAX_INT:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        self.top_k = max(self.top_k, 0)
        self.min_p = _check_float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] "
                             f"(1 is off), got {self.repetition_penalty}")

        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {type(self.seed).__name__} {self.seed!r}")
        if self.seed is not None and not -2**63 <= self.seed < 2**63:
            raise ValueError(f"seed must be a 64-bit signed int, got {self.seed}")

        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)

        self.ignore_eos = _check_bool("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _check_bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _check_bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )

        if self.max_tokens is not None:
            self.max_tokens = _check_int("max_tokens", self.max_tokens, 1)
        self.min_tokens = _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )

        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, _check_int(name, getattr(self, name), 0))
                if getattr(self, name) > MAX_LOGPROBS:
                    raise ValueError(f"{name} must be <= {MAX_LOGPROBS}, got {getattr(self, name)}")

        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:  # an unknown key
                raise ValueError(f"structured_outputs: {exc}") from None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")

    @staticmethod
    def _normalise_stop(stop: object) -> list[str]:
        # Always builds a new list, so replace()/clone() never share it with the original.
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if isinstance(stop, (list, tuple)) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a str or a list of str, got {reprlib.repr(stop)}")
        if any(s == "" for s in stop):
            raise ValueError("stop must not contain empty strings")
        longest = max(map(len, stop), default=0)
        if longest > MAX_STOP_STRING_LEN:
            raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_LEN} characters long, got one of "
                             f"{longest}")
        return list(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and 0 <= i <= MAX_INT for i in ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {ids!r}")
        return list(ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    def replace(self, **changes) -> "SamplingParams":
        """A validated copy with `changes` applied; lists are never shared with `self`."""
        return dataclasses.replace(self, **changes)

    def clone(self) -> "SamplingParams":
        return self.replace()
