import math

import pytest
import torch

from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.worker.sampler import NONFINITE, Sampler, SamplingMetadata, apply_penalties

CPU = torch.device("cpu")
sampler = Sampler()


def build(params, prompts=None, outputs=None, banned=None):
    n = len(params)
    return SamplingMetadata.build(params, prompts or [[1, 2]] * n, outputs or [[]] * n, banned, CPU)


def sample(logits, params, **kw):
    return sampler(logits, build(params, **kw))


def random_logits(rows, vocab, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_takes_the_fast_path():
    logits = random_logits(5, 100)
    meta = build([SamplingParams(temperature=0)] * 5)
    assert meta.all_greedy and meta.temperature is None and meta.penalties is None
    out = sampler(logits, meta)
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_greedy_fast_path_takes_the_first_of_ties_in_the_model_dtype(dtype):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randint(-2, 3, (40, 300), generator=gen).to(dtype)  # many ties per row
    logits[3, 7] = float("nan")  # a row with a NaN samples nothing (test_non_finite_rows_sample_nothing)
    out = sampler(logits, build([SamplingParams(temperature=0)] * 40))
    want = logits.float().argmax(-1).tolist()
    want[3] = NONFINITE
    assert out.sampled_token_ids == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["greedy", "penalised", "random", "logprobs"])
def test_non_finite_rows_sample_nothing(dtype, kind):
    """A row holding a NaN or a +inf, or nothing but -inf, samples NONFINITE (its request fails
    alone); the other rows sample as they would without it, -inf tokens (bans) being no fault.
    On every path: the plain greedy one, penalties, random sampling, logprobs."""
    logits = random_logits(6, 50, seed=3).to(dtype)
    logits[1, 4] = float("nan")
    logits[2, 9] = float("inf")
    logits[3] = float("-inf")
    logits[4, :10] = float("-inf")  # a masked part: finite enough
    params = {"greedy": SamplingParams(temperature=0), "penalised": SamplingParams(temperature=0, repetition_penalty=1.5),
              "random": SamplingParams(temperature=0.7, seed=2), "logprobs": SamplingParams(temperature=0, logprobs=2)}[kind]
    out = sample(logits, [params] * 6)
    assert [i for i, t in enumerate(out.sampled_token_ids) if t == NONFINITE] == [1, 2, 3]
    for i in (0, 4, 5):
        assert out.sampled_token_ids[i] == sample(logits[i:i + 1], [params]).sampled_token_ids[0]
    assert out.sampled_token_ids[4] >= 10
    # A penalty past what float32 holds (refused by SamplingParams; set here behind its back)
    # divides a logit by 0: that row alone samples nothing.
    broken = SamplingParams(temperature=0)
    broken.repetition_penalty = 1e-300
    out = sample(logits[[0, 5]], [broken, params], prompts=[[1, 2], [1, 2]])
    assert out.sampled_token_ids[0] == NONFINITE and out.sampled_token_ids[1] != NONFINITE


def test_input_logits_are_not_modified():
    logits = random_logits(2, 50)
    before = logits.clone()
    params = [SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.3, seed=1)] * 2
    sample(logits, params, outputs=[[1, 2], [3]], banned=[[0], [1, 2]])
    assert torch.equal(logits, before)


def test_banned_ids_are_never_sampled():
    logits = torch.zeros(64, 8)
    logits[:, 3] = 10.0  # the favourite is banned
    banned = [[3, 5]] * 64
    greedy = sample(logits, [SamplingParams(temperature=0)] * 64, banned=banned)
    assert set(greedy.sampled_token_ids) == {0}  # argmax of the rest (ties -> first)
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(64)]
    tokens = sample(logits, params, banned=banned).sampled_token_ids
    assert not {3, 5} & set(tokens)
    assert len(set(tokens)) > 3  # the remaining six tokens are equally likely


def test_seeded_sampling_is_reproducible():
    logits = random_logits(1, 1000)
    params = [SamplingParams(temperature=1.5, seed=1234)]
    first = [sample(logits, params, outputs=[[0] * pos]).sampled_token_ids[0] for pos in range(20)]
    torch.manual_seed(99)  # the global RNG must not matter
    again = [sample(logits, params, outputs=[[0] * pos]).sampled_token_ids[0] for pos in range(20)]
    assert first == again


def test_seeded_row_is_independent_of_the_batch():
    logits = random_logits(4, 500, seed=1)
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    others = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.3, top_k=3, min_p=0.2, repetition_penalty=1.5, presence_penalty=1.0),
        SamplingParams(temperature=0.7, frequency_penalty=-1.0, logprobs=5),
    ]
    for pos in range(10):
        outputs = [[11] * pos, [4, 4, 5], [7], [9, 9]]
        alone = sample(logits[:1], [target], outputs=outputs[:1]).sampled_token_ids[0]
        batched = sample(logits, [target, *others], outputs=outputs, banned=[[], [2], [], [3]])
        assert batched.sampled_token_ids[0] == alone
        # Same row, same position, placed last in the batch.
        shuffled = torch.cat([logits[1:], logits[:1]])
        moved = sample(shuffled, [*others, target], outputs=[*outputs[1:], outputs[0]])
        assert moved.sampled_token_ids[3] == alone


def test_positions_and_seeds_give_different_streams():
    logits = torch.zeros(1, 1000)  # uniform: every token equally likely

    def stream(seed):
        params = [SamplingParams(seed=seed)]
        return [sample(logits, params, outputs=[[0] * pos]).sampled_token_ids[0] for pos in range(20)]

    a, b = stream(1), stream(2)
    assert len(set(a)) > 15 and len(set(b)) > 15
    assert a != b


def test_top_k_1_and_tiny_top_p_equal_greedy():
    logits = random_logits(16, 300, seed=3)
    greedy = logits.argmax(-1).tolist()
    for extra in ({"top_k": 1}, {"top_p": 1e-6}):
        params = [SamplingParams(temperature=2.0, seed=i, **extra) for i in range(16)]
        assert sample(logits, params).sampled_token_ids == greedy
        unseeded = [SamplingParams(temperature=2.0, **extra) for _ in range(16)]
        assert sample(logits, unseeded).sampled_token_ids == greedy


PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def draws(extra, rows=400):
    logits = PROBS.log().expand(rows, -1)
    params = [SamplingParams(seed=i, **extra) for i in range(rows)]
    return set(sample(logits, params).sampled_token_ids)


def test_top_k_top_p_min_p_filter():
    assert draws({}) == {0, 1, 2, 3}
    assert draws({"top_k": 2}) == {0, 1}
    assert draws({"top_p": 0.7}) == {0, 1}  # 0.5 + 0.3 is the smallest set reaching 0.7
    assert draws({"top_p": 0.85}) == {0, 1, 2}
    assert draws({"min_p": 0.2}) == {0, 1, 2}  # keeps p >= 0.2 * 0.5 = 0.1
    assert draws({"min_p": 0.7}) == {0}
    assert draws({"top_k": 3, "top_p": 0.6}) == {0, 1}  # top-p over the renormalised top 3


def test_penalties_match_hand_computed_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),
    ]
    meta = build(params, prompts=[[0], [0, 1]], outputs=[[1, 2, 2], [2, 3]])
    penalised = apply_penalties(logits, meta.penalties)
    # token 0: prompt only, positive -> 2 / 2
    # token 1: output once, negative -> -1 * 2 - 0.5 * 1 - 0.25
    # token 2: output twice, positive -> 0.5 / 2 - 0.5 * 2 - 0.25
    # token 3: unseen -> unchanged
    assert penalised[0].tolist() == [1.0, -2.75, -1.0, 3.0]
    assert torch.equal(penalised[1], logits[1])  # a row with default penalties is untouched


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    greedy = SamplingParams(temperature=0)
    assert sample(logits, [greedy], outputs=[[0]]).sampled_token_ids == [0]
    assert build([greedy]).penalties is None
    for penalty in ({"repetition_penalty": 1.2}, {"frequency_penalty": 0.2}, {"presence_penalty": 0.2}):
        params = [greedy.replace(**penalty)]
        assert sample(logits, params, prompts=[[2]], outputs=[[0]]).sampled_token_ids == [1]
    # Repetition also counts prompt tokens; frequency and presence do not.
    assert sample(logits, [greedy.replace(repetition_penalty=1.2)], prompts=[[0]]).sampled_token_ids == [1]
    assert sample(logits, [greedy.replace(presence_penalty=0.2)], prompts=[[0]]).sampled_token_ids == [0]


def test_mixed_greedy_and_random_rows():
    logits = random_logits(6, 200, seed=5)
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, seed=i) for i in range(6)]
    params.append(SamplingParams(temperature=1.0))  # unseeded: noise is drawn for every row
    logits = torch.cat([logits, logits[:1]])
    tokens = sample(logits, params).sampled_token_ids
    argmax = logits.argmax(-1).tolist()
    assert [tokens[i] for i in (1, 3, 5)] == [argmax[i] for i in (1, 3, 5)]
    for i in (0, 2, 4):
        alone = sample(logits[i : i + 1], [params[i]]).sampled_token_ids[0]
        assert tokens[i] == alone


def test_logprobs_sampled_first_with_values_and_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, -1.0], [0.0, 0.5, 1.0, 1.5, 2.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    params = [
        # Banned and penalised: the sampled token is not the raw argmax, logprobs stay raw.
        SamplingParams(temperature=0, logprobs=3, repetition_penalty=2.0),
        SamplingParams(temperature=0.5, seed=0, logprobs=0),
        SamplingParams(temperature=0),
    ]
    out = sample(logits, params, outputs=[[2], [], []], banned=[[1, 3], [], []])
    assert out.sampled_token_ids[0] == 0  # 1 and 3 banned, 2 halved to 1.0, ties -> first
    expected = torch.log_softmax(logits, dim=-1)

    row0 = out.logprobs[0]
    assert len(row0) == 1 + 3
    assert row0[0][0] == 0 and row0[0][1] == pytest.approx(expected[0, 0].item()) and row0[0][2] == 4
    # Top 3 in descending order: the tied pair 1 and 3 both rank 1, then token 2 ranks 3.
    assert sorted(t for t, _, _ in row0[1:3]) == [1, 3]
    assert [r for _, _, r in row0[1:]] == [1, 1, 3]
    assert row0[3][0] == 2
    for token, lp, _ in row0:
        assert lp == pytest.approx(expected[0, token].item(), abs=1e-6)

    token1 = out.sampled_token_ids[1]
    rank1 = 1 + int((expected[1] > expected[1, token1]).sum())
    assert out.logprobs[1] == [(token1, pytest.approx(expected[1, token1].item()), rank1)]
    assert out.logprobs[2] == []


def test_logprobs_are_computed_from_raw_logits():
    logits = random_logits(1, 64, seed=8)
    params = [SamplingParams(temperature=0.3, top_k=4, seed=5, logprobs=MAX_LOGPROBS)]
    out = sample(logits, params)
    lp = torch.log_softmax(logits[0], dim=-1)
    top = lp.topk(MAX_LOGPROBS)
    row = out.logprobs[0]
    assert [t for t, _, _ in row[1:]] == top.indices.tolist()
    assert [r for _, _, r in row[1:]] == list(range(1, MAX_LOGPROBS + 1))
    for token, value, _ in row:
        assert value == pytest.approx(lp[token].item(), abs=1e-6)
    assert math.isclose(sum(math.exp(v) for v in lp.tolist()), 1.0, rel_tol=1e-5)


@pytest.mark.parametrize(("temperature", "expected"), [(1.0, [0.5, 0.3, 0.2]), (0.5, [25 / 38, 9 / 38, 4 / 38])])
def test_temperature_sampling_follows_the_distribution(temperature, expected):
    probs = torch.tensor([0.5, 0.3, 0.2])
    rows = 2000
    logits = probs.log().expand(rows, -1)
    seeded = [SamplingParams(temperature=temperature, seed=i) for i in range(rows)]
    torch.manual_seed(0)  # makes the unseeded (global RNG) draw deterministic too
    unseeded = [SamplingParams(temperature=temperature)] * rows
    for params in (seeded, unseeded):
        counts = torch.bincount(torch.tensor(sample(logits, params).sampled_token_ids), minlength=3)
        freq = (counts / rows).tolist()
        assert freq == pytest.approx(expected, abs=0.04)
