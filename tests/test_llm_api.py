"""The offline LLM API: inputs, outputs, sampling options and clear errors."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.llm_engine import OutputKind
from tests.conftest import assert_engine_idle

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), num_blocks=200, max_model_len=512)


@pytest.fixture(autouse=True)
def _idle_after(request):
    yield
    if "llm" in request.fixturenames:
        assert_engine_idle(request.getfixturevalue("llm"))


def test_prompt_forms_and_order(llm):
    params = SamplingParams(max_tokens=6, **GREEDY)
    texts = ["Hello there", "A much longer prompt about the weather in Paris today", "x"]
    outs = llm.generate(texts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == texts
    single = llm.generate(texts[1], params, use_tqdm=False)
    assert single[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    ids = outs[1].prompt_token_ids
    by_ids = llm.generate(ids, params, use_tqdm=False)
    assert by_ids[0].prompt is None and by_ids[0].prompt_token_ids == ids
    assert by_ids[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    many = llm.generate([ids, outs[0].prompt_token_ids], params, use_tqdm=False)
    assert [m.outputs[0].token_ids for m in many] == [outs[1].outputs[0].token_ids, outs[0].outputs[0].token_ids]
    for o in outs:
        c = o.outputs[0]
        assert o.finished and c.finish_reason == "length" and len(c.token_ids) == 6
        assert c.text == llm.get_tokenizer().decode(c.token_ids)


def test_per_prompt_sampling_params(llm):
    outs = llm.generate(["a", "b"], [SamplingParams(max_tokens=3, **GREEDY), SamplingParams(max_tokens=7, **GREEDY)],
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7]
    with pytest.raises(ValueError, match="2 prompts but 1"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_n_and_seed(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=123, max_tokens=12, ignore_eos=True)
    first = llm.generate("Tell me a story", params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in first.outputs]
    assert len(set(samples)) == 3, "the n samples should differ"
    # Reproducible, and independent of what else is in the batch.
    again = llm.generate(["other prompt", "Tell me a story"], [SamplingParams(max_tokens=5), params],
                         use_tqdm=False)[1]
    assert [tuple(c.token_ids) for c in again.outputs] == samples


def test_stop_strings(llm):
    base = llm.generate("The weather", SamplingParams(max_tokens=16, **GREEDY), use_tqdm=False)[0].outputs[0]
    text = base.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = text.index(stop)
    assert cut > 0
    out = llm.generate("The weather", SamplingParams(max_tokens=16, stop=[stop], **GREEDY), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.text == text[:cut] and c.finish_reason == "stop" and c.stop_reason == stop
    inc = llm.generate("The weather", SamplingParams(max_tokens=16, stop=stop, include_stop_str_in_output=True,
                                                      **GREEDY), use_tqdm=False)[0].outputs[0]
    assert inc.text == text[:cut + len(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    base = llm.generate("Numbers", SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0].outputs[0].token_ids
    stop_id = base[4]
    first = base.index(stop_id)
    out = llm.generate("Numbers", SamplingParams(max_tokens=12, stop_token_ids=[stop_id], **GREEDY),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens bans the stop token until it is reached, so the output differs from there on.
    out = llm.generate("Numbers", SamplingParams(max_tokens=12, min_tokens=first + 2, stop_token_ids=[stop_id],
                                                 **GREEDY), use_tqdm=False)[0].outputs[0]
    assert stop_id not in out.token_ids[:first + 2]


def test_eos_stops_unless_ignored(llm):
    """The model's EOS is made a token greedy decoding surely produces (the tiny random model
    rarely emits its real one): a request stops at it, with "stop", unless it ignores EOS."""
    prompt = [11, 12, 13, 14]
    free = llm.generate(prompt, SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)[0].outputs[0].token_ids
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    core, real = llm.engine.core, llm.engine.core.eos_token_ids
    core.eos_token_ids = frozenset({free[k]})
    try:
        stopped = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0].outputs[0]
        ignored = llm.generate(prompt, SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)[0].outputs[0]
    finally:
        core.eos_token_ids = real
    assert stopped.token_ids == free[:k + 1] and stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert ignored.token_ids == free and ignored.finish_reason == "length"


def test_logprobs(llm):
    import math
    out = llm.generate("Hi", SamplingParams(max_tokens=5, logprobs=3, **GREEDY), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        assert len(entry) == 3  # the greedy token is the top one: exactly k entries
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert math.isclose(out.cumulative_logprob, sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)),
                        rel_tol=1e-5)


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert tok.decode(out.prompt_token_ids).startswith("<|im_start|>system")
    assert tok.decode(out.prompt_token_ids).endswith("<|im_start|>assistant\n")
    two = llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
                   SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    assert len(two) == 2


def test_streaming_deltas_concatenate_to_final_text(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=20, stop=["zz-never"], **GREEDY)
    engine.add_request("stream", "Streaming text", params, OutputKind.DELTA)
    text, tokens = "", []
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                text += c.text
                tokens += c.token_ids
    final = llm.generate("Streaming text", params, use_tqdm=False)[0].outputs[0]
    assert tokens == final.token_ids and text == final.text


@pytest.mark.parametrize("prompt, params, match", [
    ("", SamplingParams(), "prompt must not be empty"),
    ([[]], SamplingParams(), "prompt must not be empty"),
    ([10**6], SamplingParams(), "out of vocabulary"),
    ([5] * 600, SamplingParams(), "maximum context length is 512"),
    ([5] * 500, SamplingParams(max_tokens=100), "requested 100 output tokens.*500 input tokens"),
])
def test_bad_requests_raise_clear_errors(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params, use_tqdm=False)


@pytest.fixture(scope="module")
def small(tiny_llama) -> LLM:
    """A pool of 16 tokens (4 blocks of 4) under a context of 512."""
    return LLM(str(tiny_llama), num_blocks=4, block_size=4, max_model_len=512)


def test_request_larger_than_pool_is_rejected(small):
    with pytest.raises(ValueError, match="KV blocks.*whole KV pool has 4.*at most 7 output tokens fit"):
        small.generate([5] * 10, SamplingParams(max_tokens=10), use_tqdm=False)
    # The engine keeps serving requests that fit.
    assert len(small.generate([5] * 4, SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)[0]
               .outputs[0].token_ids) == 4
    assert_engine_idle(small)


def test_unset_max_tokens_grows_until_the_pool_is_full(small):
    """A request without max_tokens (chat's default) on a pool smaller than the context is
    admitted, grows block by block and ends ("length") when its sequence fills the whole pool
    (16 tokens computed, the 17th sampled); two of them preempt each other and both end, each
    with what it would have generated alone. Only a prompt the pool cannot hold is refused."""
    unset = SamplingParams(max_tokens=None, **GREEDY)
    outs = small.generate([[5] * 10, [6] * 3], unset, use_tqdm=False)
    assert [(len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs] == [(7, "length"), (14, "length")]
    alone = small.generate([[6] * 3], unset, use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == outs[1].outputs[0].token_ids
    assert small.engine.scheduler.stats.num_preemptions > 0
    with pytest.raises(ValueError, match="prompt's 17 tokens need 5 KV blocks.*whole KV pool has 4"):
        small.generate([5] * 17, unset, use_tqdm=False)
    assert_engine_idle(small)


def test_non_finite_logits_fail_their_request_alone(llm):
    """A request whose logits are not finite once its parameters are applied (here a penalty
    that is 0 in float32, set behind SamplingParams' back: it refuses it) samples nothing: it
    ends with finish reason "error" and says why; the requests in its batch answer as alone."""
    prompts = ["One request in the batch", "Another one, poisoned", "And a third"]
    good = SamplingParams(max_tokens=6, **GREEDY)
    poisoned = good.clone()
    poisoned.repetition_penalty = 1e-300
    alone = llm.generate([prompts[0], prompts[2]], good, use_tqdm=False)
    outs = llm.generate(prompts, [good, poisoned, good], use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error" and outs[1].outputs[0].token_ids == []
    assert "non-finite logits" in outs[1].error
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == [o.outputs[0].token_ids for o in alone]
    assert all(o.outputs[0].finish_reason == "length" for o in (outs[0], outs[2]))


def test_invalid_sampling_params_name_the_field():
    for kwargs, field in [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                          (dict(top_k=-5), "top_k"), (dict(max_tokens=0), "max_tokens"),
                          (dict(n=0), "n"), (dict(stop=[""]), "stop"), (dict(logprobs=99), "logprobs"),
                          (dict(min_tokens=5, max_tokens=2), "min_tokens"),
                          (dict(repetition_penalty=1e-300), "repetition_penalty")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def _drain(engine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_first_tokens_from_a_prefill_continue_and_finish_on_arrival(llm):
    """Issue 13, in process: a request carrying the first token another instance sampled
    continues from it exactly (greedy: the same answer); one whose first token already ends it
    (max_tokens 1) finishes on arrival; aborting that one before the next step, then reusing its
    id, neither crashes the step nor hands the new request the old output."""
    from engine.kv_transfer.params import token_digest
    engine = llm.engine
    prompt = engine.tokenizer.encode("Continue from the first token")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    first = {"first_token_ids": [want.token_ids[0]], "first_tokens_digest": token_digest(prompt)}
    engine.add_request("cont", prompt, params, kv_transfer_params=first)
    out = [o for o in _drain(engine) if o.finished][0]
    assert out.outputs[0].token_ids == want.token_ids and out.outputs[0].text == want.text
    engine.add_request("done", prompt, params.replace(max_tokens=1), kv_transfer_params=first)
    engine.abort_request("done")
    assert _drain(engine) == []
    engine.add_request("done", prompt, params, OutputKind.FINAL_ONLY)
    (out,) = _drain(engine)
    assert out.request_id == "done" and out.outputs[0].token_ids == want.token_ids
    # First tokens sampled for another prompt are not used: it samples its own.
    engine.add_request("other", prompt[:-1], params, kv_transfer_params=first)
    (out,) = [o for o in _drain(engine) if o.finished]
    assert out.outputs[0].token_ids == llm.generate([prompt[:-1]], params, use_tqdm=False)[0].outputs[0].token_ids


def test_do_remote_decode_is_ignored_without_a_kv_connector(llm):
    """Only an instance that can hand its KV on (a prefill, a KV store) ends a request after its
    first token; a plain one answers in full and hands out no parameters."""
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    (out,) = llm.generate(["no connector here"], params, use_tqdm=False)
    llm.engine.add_request("p", "no connector here", params, OutputKind.FINAL_ONLY,
                           kv_transfer_params={"do_remote_decode": True})
    (got,) = _drain(llm.engine)
    assert got.outputs[0].token_ids == out.outputs[0].token_ids and got.kv_transfer_params is None
