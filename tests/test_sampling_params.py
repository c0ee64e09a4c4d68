import math

import pytest

from engine.sampling_params import (
    MAX_LOGPROBS,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    SamplingParams,
    SamplingType,
)


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == []
    assert p.ignore_eos is False and p.skip_special_tokens is True and p.include_stop_str_in_output is False
    assert (p.max_tokens, p.min_tokens, p.logprobs) == (16, 0, None)
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy


INVALID = [
    ("n", 0),
    ("n", -1),
    ("n", 1.5),
    ("n", True),
    ("n", "2"),
    ("temperature", -1.0),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "hot"),
    ("temperature", None),
    ("temperature", 1e308),  # inf in float32: a banned token's -inf / inf is NaN
    ("top_p", 0.0),
    ("top_p", -0.1),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("top_p", "all"),
    ("top_k", -5),
    ("top_k", -2),
    ("top_k", 2.5),
    ("top_k", True),
    ("top_k", None),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("min_p", math.nan),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.1),
    ("presence_penalty", math.inf),
    ("frequency_penalty", 3),
    ("frequency_penalty", -2.5),
    ("frequency_penalty", "x"),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("repetition_penalty", math.nan),
    ("repetition_penalty", 1e-300),  # 0 in float32: a logit divided by it is inf
    ("repetition_penalty", 1e7),
    ("seed", 1.5),
    ("seed", "42"),
    ("seed", True),
    ("stop", 5),
    ("stop", [""]),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", ["ok", 3]),
    ("stop", ["s"] * (MAX_STOP_STRINGS + 1)),
    ("stop", "s" * (MAX_STOP_STRING_LEN + 1)),
    ("stop", ["ok", "s" * (MAX_STOP_STRING_LEN + 1)]),
    ("stop_token_ids", [1, "2"]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 7),
    ("ignore_eos", 1),
    ("skip_special_tokens", "yes"),
    ("include_stop_str_in_output", None),
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", "ten"),
    ("max_tokens", 10.0),
    ("max_tokens", True),
    ("min_tokens", -1),
    ("min_tokens", 1.5),
    ("min_tokens", None),
    ("logprobs", -1),
    ("logprobs", MAX_LOGPROBS + 1),
    ("logprobs", 2.0),
    ("logprobs", True),
]


@pytest.mark.parametrize(("field", "value"), INVALID)
def test_invalid_value_raises_value_error_naming_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"^min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=10_000).min_tokens == 10_000
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5


def test_temperature_message():
    with pytest.raises(ValueError, match=r"^temperature must be >= 0 and finite, got -1.0$"):
        SamplingParams(temperature=-1.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": 0, "n": 3},  # greedy with n > 1 is allowed here (vLLM rejects it)
        {"temperature": 5.0},
        {"top_p": 1e-9},
        {"top_k": 1},
        {"min_p": 1.0},
        {"presence_penalty": -2, "frequency_penalty": 2},
        {"repetition_penalty": 1e-3},
        {"seed": -7},
        {"max_tokens": None},
        {"max_tokens": 1},
        {"logprobs": 0},
        {"logprobs": MAX_LOGPROBS},
        {"stop_token_ids": (2, 0)},
    ],
)
def test_valid_edge_values(kwargs):
    SamplingParams(**kwargs)


def test_int_given_for_float_field_becomes_float():
    p = SamplingParams(temperature=1, top_p=1, repetition_penalty=2)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert p.repetition_penalty == 2.0


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop_token_ids=(5, 6)).stop_token_ids == [5, 6]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(top_k=40).top_k == 40


def test_sampling_type():
    assert SamplingParams(temperature=0.0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6, seed=1).is_greedy
    assert SamplingParams(temperature=1e-4).sampling_type is SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=3).sampling_type is SamplingType.RANDOM_SEED


def test_replace_revalidates_and_clone_does_not_share_lists():
    p = SamplingParams(stop=["x"], stop_token_ids=[1])
    q = p.replace(max_tokens=3, top_k=-1)
    assert (q.max_tokens, q.top_k, q.stop) == (3, 0, ["x"])
    with pytest.raises(ValueError, match="^temperature"):
        p.replace(temperature=-2)
    c = p.clone()
    c.stop.append("y")
    c.stop_token_ids.append(2)
    assert c == SamplingParams(stop=["x", "y"], stop_token_ids=[1, 2])
    assert p.stop == ["x"] and p.stop_token_ids == [1]
