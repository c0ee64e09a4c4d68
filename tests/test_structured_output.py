"""Structured output: JSON schemas, regex, choice and grammars constrain what is sampled, in
the offline API and the server, batched with free requests, through preemption and prefix
hits, with n > 1 and seeds. An independent llguidance matcher checks every output token."""
from __future__ import annotations

import json
import os
import random
import re
from concurrent.futures import Future

import jsonschema
import llguidance
import llguidance.hf
import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.grammar import RequestGrammar, bitmask_to_bound, bitmask_to_bound_on_device
from engine.ipc import AddRequest
from engine.structured_output import StructuredOutputsParams as SO
from engine.worker.sampler import Sampler, SamplingMetadata
from entrypoints.protocol import BodyError, ChatCompletionRequest, CompletionRequest
from tests.conftest import assert_engine_idle
from tests.structured_schemas import SCHEMAS

EXAMPLES = int(os.environ.get("ENGINE_FUZZ_EXAMPLES", "12"))
VOCAB = 49152


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), num_blocks=256, max_model_len=1024)


@pytest.fixture(scope="module")
def ll_tokenizer(tiny) -> llguidance.LLTokenizer:
    engine = tiny.engine
    return llguidance.hf.from_tokenizer(engine.tokenizer, n_vocab=engine.vocab_size,
                                        eos_token=sorted(engine.eos_token_ids))


def assert_obeys(ll_tokenizer, so: SO, output) -> None:
    """An independent matcher accepts every token; a finished ("stop") output completes the grammar."""
    matcher = llguidance.LLMatcher(ll_tokenizer, so.grammar_spec(), log_level=0)
    assert matcher.consume_tokens(list(output.token_ids)), (matcher.get_error(), output.text)
    if output.finish_reason == "stop":
        assert matcher.is_stopped() or matcher.is_accepting(), output.text


# ---- parameters and the edge ---------------------------------------------------------------
def test_each_kind_is_accepted_and_exactly_one_is_required():
    for kwargs in ({"json": {"type": "object"}}, {"json": '{"type": "integer"}'}, {"regex": "a+"},
                   {"choice": ["x", "y"]}, {"grammar": 'start: "a" | "b"'}, {"json_object": True}):
        so = SO(**kwargs)
        so.check()
        assert so.kind == next(iter(kwargs))
    for kwargs in ({}, {"regex": "a", "choice": ["a"]}, {"json_object": False}):
        with pytest.raises(ValueError, match="exactly one"):
            SO(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "json"),
    ({"json": "{not json"}, "json"),
    ({"json": [1, 2]}, "json"),
    ({"regex": "a(b"}, "regex"),
    ({"grammar": "start: foo"}, "grammar"),
    ({"choice": []}, "choice"),
    ({"choice": ["a", 1]}, "choice"),
    ({"regex": 5}, "regex"),
])
def test_invalid_specs_name_their_field(kwargs, field):
    with pytest.raises(ValueError) as exc:
        SO(**kwargs).check()
    assert str(exc.value).startswith(field), exc.value


def test_listed_properties_close_an_object_unless_it_says_otherwise():
    so = SO(json={"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},  # a property named so
        "open": {"type": "object", "properties": {}, "additionalProperties": True}},
        "$defs": {"p": {"properties": {"y": {}}}}})
    schema = json.loads(so.json)
    assert schema["additionalProperties"] is False
    assert schema["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in schema["properties"]  # the mapping of names is not a schema
    assert schema["properties"]["open"]["additionalProperties"] is True
    assert schema["$defs"]["p"]["additionalProperties"] is False
    assert list(schema["properties"]) == ["properties", "open"]  # the schema's order is the output's
    # Parts of a combination add properties to each other: none of them is closed.
    for combined in ({"allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
                     {"properties": {"x": {"type": "integer"}},
                      "anyOf": [{"properties": {"y": {"type": "integer"}}, "required": ["y"]}]}):
        so = SO(json=combined)
        so.check()
        assert "additionalProperties" not in so.json


def test_limits_and_null_options():
    assert SO(regex="a", disable_any_whitespace=None).disable_any_whitespace is False
    with pytest.raises(ValueError, match="^regex is 300000 characters"):
        SO(regex="a" * 300_000)
    with pytest.raises(ValueError, match="^choice is"):
        SO(choice=["x" * 1000] * 300)
    with pytest.raises(ValueError, match="^json: not valid JSON"):
        SO(json="[" * 100_000)
    SO(grammar='root ::= "yes" | "no"').check()  # GBNF as well as Lark
    SO(grammar='start: "a" "::=" "b"').check()  # Lark, though "::=" appears in it
    with pytest.raises(ValueError, match="^grammar"):
        SO(grammar="root ::= missing").check()


def test_params_cross_the_process_boundary():
    params = SamplingParams(max_tokens=5, structured_outputs=SO(json={"type": "object", "properties": {
        "b": {"type": "integer"}, "a": {"type": "string"}}}))
    msg = AddRequest("r", [1, 2], params, 0.0)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=AddRequest)
    assert back.params.structured_outputs == params.structured_outputs
    assert back.params.structured_outputs.grammar_spec() == params.structured_outputs.grammar_spec()


@pytest.mark.parametrize("body, expected", [
    ({"response_format": {"type": "json_object"}}, SO(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                 "schema": {"type": "integer"}}}},
     SO(json={"type": "integer"})),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"regex": "[ab]+"}}, SO(regex="[ab]+")),
    ({"guided_json": '{"type": "boolean"}', "guided_whitespace_pattern": " ?"},
     SO(json={"type": "boolean"}, whitespace_pattern=" ?")),
    ({"guided_regex": "a"}, SO(regex="a")),
    ({"guided_choice": ["p", "q"]}, SO(choice=["p", "q"])),
    ({"guided_grammar": 'start: "z"'}, SO(grammar='start: "z"')),
])
def test_every_request_form_becomes_the_same_params(body, expected):
    for model, base in ((CompletionRequest, {"prompt": "hi"}), (ChatCompletionRequest, {"messages": []})):
        request = model.model_validate({**base, **body})
        assert request.sampling_params(8, None).structured_outputs == expected


@pytest.mark.parametrize("body, param", [
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_json": "{oops"}, "guided_json"),
])
def test_bad_request_forms_name_the_field(body, param):
    request = CompletionRequest.model_validate({"prompt": "hi", **body})
    with pytest.raises(BodyError) as exc:
        request.sampling_params(8, None)
    assert exc.value.status == 400 and exc.value.param == param, exc.value.message


def test_bitmask_becomes_an_exact_upper_bound():
    rng = np.random.default_rng(0)
    bitmask = rng.integers(-2**31, 2**31 - 1, size=(3, 4), dtype=np.int32)  # 128 bits, vocab 100
    bound = bitmask_to_bound(bitmask, 100)
    words = bitmask.view(np.uint32)
    expected = [[np.inf if (int(words[r, t // 32]) >> (t % 32)) & 1 else -np.inf for t in range(100)]
                for r in range(3)]
    assert bound.dtype == np.float32 and bound.tolist() == expected
    # The device path (GPUs: the packed mask crosses, is unpacked there) gives the same bound.
    on_device = bitmask_to_bound_on_device(torch.from_numpy(bitmask), 100)
    assert on_device.dtype == torch.float32 and on_device.tolist() == expected


def test_sampler_masks_only_the_grammar_rows():
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    allowed = [5, 17, 64]
    bitmask = np.zeros((1, 4), dtype=np.int32)
    for t in allowed:
        bitmask.view(np.uint32)[0, t // 32] |= np.uint32(1 << (t % 32))
    grammar = (torch.tensor([1]), torch.from_numpy(bitmask_to_bound(bitmask, 100)))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, min_tokens=3),
              SamplingParams(temperature=0.8, seed=3)]
    cpu = torch.device("cpu")
    free = Sampler()(logits, SamplingMetadata.build(params, [[1]] * 3, [[]] * 3, None, cpu))
    masked = Sampler()(logits, SamplingMetadata.build(params, [[1]] * 3, [[]] * 3, None, cpu, grammar=grammar))
    assert masked.sampled_token_ids[1] == max(allowed, key=lambda t: logits[1, t])
    assert masked.sampled_token_ids[0] == free.sampled_token_ids[0]
    assert masked.sampled_token_ids[2] == free.sampled_token_ids[2]
    # min_tokens bans every token the grammar allows (its EOS, say): the grammar wins.
    banned = Sampler()(logits, SamplingMetadata.build(params, [[1]] * 3, [[]] * 3, [[], allowed, []], cpu,
                                                      grammar=grammar))
    assert banned.sampled_token_ids[1] in allowed
    # An overflowed (+inf) logit of a token the grammar forbids is still forbidden, not NaN.
    logits[1, 3] = float("inf")
    masked = Sampler()(logits, SamplingMetadata.build(params, [[1]] * 3, [[]] * 3, None, cpu, grammar=grammar))
    assert masked.sampled_token_ids[1] in allowed
    # Every row constrained: the same result through the whole-batch path.
    everything = (torch.arange(3), torch.from_numpy(bitmask_to_bound(np.repeat(bitmask, 3, axis=0), 100)))
    allrows = Sampler()(logits, SamplingMetadata.build(params, [[1]] * 3, [[]] * 3, None, cpu, grammar=everything))
    assert all(t in allowed for t in allrows.sampled_token_ids)


def test_tokens_accepted_before_the_compile_finished_are_replayed(ll_tokenizer, tiny):
    """A decode instance gets the prefill's first token when the request arrives, usually
    before its grammar is compiled: the matcher must start from that token."""
    so = SO(choice=["alpha", "beta"])
    tokens = tiny.engine.tokenizer.encode("alpha", add_special_tokens=False)
    compiled: Future = Future()
    grammar = RequestGrammar(compiled, tiny.engine.grammar_compiler)
    for t in tokens[:-1]:
        grammar.accept(t)
    assert not grammar.ready()
    compiled.set_result(llguidance.LLMatcher(ll_tokenizer, so.grammar_spec(), log_level=0))
    row = np.zeros(VOCAB // 32, dtype=np.int32)
    grammar.fill_bitmask(row)
    allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
    assert tokens[-1] in allowed and len(allowed) < 10  # only continuations of "alpha"
    grammar.accept(tokens[-1])
    grammar.fill_bitmask(row)
    assert set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))) <= set(tiny.engine.eos_token_ids)


# ---- the engine ---------------------------------------------------------------------------
BOUNDED = SCHEMAS["array_of_objects"]
KINDS = [SO(regex=r"[a-z]{2,5}-[0-9]{2}"), SO(choice=["alpha", "beta", "gamma delta"]),
         SO(grammar='start: "(" DIGIT ("+" DIGIT){0,3} ")"\nDIGIT: /[0-9]/'), SO(json=BOUNDED),
         SO(json=SCHEMAS["person_record"]), SO(grammar='root ::= "<" [a-c]{1,3} ">"')]


def test_regex_choice_grammar_and_json_outputs_obey(tiny, ll_tokenizer):
    prompts = [_prompt(20 + 7 * i, i) for i in range(len(KINDS))]
    params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=so) for so in KINDS]
    outs = tiny.generate(prompts, params, use_tqdm=False)
    for so, out in zip(KINDS, outs):
        assert_obeys(ll_tokenizer, so, out.outputs[0])
    texts = [o.outputs[0].text for o in outs]
    assert re.fullmatch(r"[a-z]{2,5}-[0-9]{2}", texts[0])
    assert texts[1] in ("alpha", "beta", "gamma delta")
    assert re.fullmatch(r"\([0-9](\+[0-9]){0,3}\)", texts[2])
    assert re.fullmatch(r"<[a-c]{1,3}>", texts[5])
    for out, schema in ((outs[3], BOUNDED), (outs[4], SCHEMAS["person_record"])):
        if out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert_engine_idle(tiny)


def test_n_samples_with_seeds_all_obey_and_reproduce(tiny, ll_tokenizer):
    for so in KINDS[:3]:
        params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=40, structured_outputs=so)
        first = tiny.generate([_prompt(30, 5)], params, use_tqdm=False)[0]
        again = tiny.generate([_prompt(30, 5)], params, use_tqdm=False)[0]
        assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
        for c in first.outputs:
            assert_obeys(ll_tokenizer, so, c)
    assert_engine_idle(tiny)


def test_constrained_and_free_requests_share_a_batch_without_changing_outputs(tiny_llama, tiny):
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [_prompt(10 + 9 * i, 100 + i) for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=KINDS[i % len(KINDS)])
              if i % 2 else free for i in range(6)]
    solo = [tiny.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    hits = tiny.engine.kv_cache_manager.stats.hits
    batched = [o.outputs[0].token_ids for o in tiny.generate(prompts, params, use_tqdm=False)]
    assert batched == solo
    assert tiny.engine.kv_cache_manager.stats.hits > hits  # the second time, from the prefix cache
    # Preempted and recomputed in a tiny pool: the grammar state survives.
    small = LLM(str(tiny_llama), num_blocks=24, block_size=4, max_model_len=1024, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)] == solo
    assert small.engine.scheduler.stats.num_preemptions > 0
    assert_engine_idle(small)


def test_a_grammar_that_cannot_finish_ends_with_length(tiny, ll_tokenizer):
    so = SO(regex="[0-9]{60}")
    out = tiny.generate([_prompt(12, 3)], SamplingParams(temperature=0, max_tokens=4, structured_outputs=so),
                        use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert_obeys(ll_tokenizer, so, out)


@pytest.mark.parametrize("extra", [{"min_tokens": 6}, {"ignore_eos": True}])
def test_min_tokens_and_ignore_eos_cannot_push_an_output_past_its_grammar(tiny, extra):
    so = SO(choice=["yes", "no"])
    out = tiny.generate([_prompt(12, 4)], SamplingParams(temperature=0, max_tokens=10, structured_outputs=so,
                                                         skip_special_tokens=False, **extra),
                        use_tqdm=False)[0].outputs[0]
    eos = tiny.engine.eos_token_ids
    assert out.finish_reason == "stop" and out.token_ids[-1] in eos and not any(t in eos for t in out.token_ids[:-1])
    assert tiny.engine.tokenizer.decode(out.token_ids[:-1]) in ("yes", "no")


def test_each_grammar_compiles_once_and_a_bad_one_fails_only_its_request(tiny):
    engine = tiny.engine
    so = SO(json={"type": "object", "properties": {"k": {"enum": ["v", "w"]}}, "required": ["k"]})
    before = engine.grammar_compiler.num_compiled
    outs = tiny.generate([_prompt(9, i) for i in range(4)],
                         SamplingParams(temperature=0, max_tokens=30, structured_outputs=so), use_tqdm=False)
    assert engine.grammar_compiler.num_compiled == before + 1
    assert all(json.loads(o.outputs[0].text)["k"] in ("v", "w") for o in outs)
    # The offline API checks at the edge: nothing is queued for a bad regex.
    with pytest.raises(ValueError, match="^regex"):
        tiny.generate([_prompt(9, 1), _prompt(9, 2)], [
            SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, structured_outputs=SO(regex="(("))])
    assert_engine_idle(tiny)
    # Past the edge (a core fed directly), it ends its own request with an error, nothing else.
    engine.add_request("bad", _prompt(9, 1), SamplingParams(max_tokens=4, structured_outputs=SO(regex="((")))
    engine.add_request("good", _prompt(9, 2), SamplingParams(max_tokens=4, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["bad"].outputs[0].finish_reason == "error" and "compile" in finished["bad"].error
    assert finished["good"].outputs[0].finish_reason == "length"
    assert_engine_idle(tiny)


# ---- generated schemas --------------------------------------------------------------------
_leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-1000, 1000), st.integers(0, 500)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=4, unique=True).map(
        lambda xs: {"enum": xs}),
    st.just({"type": "null"}),
)


def _object(children):
    return st.dictionaries(st.text("abcdefgh", min_size=1, max_size=5), children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda required: {"type": "object", "properties": props, "required": required}))


_schemas = st.recursive(_leaf, lambda children: st.one_of(
    _object(children),
    st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, children, st.integers(0, 3))),
    max_leaves=6)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=False,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=_schemas, seed=st.integers(0, 2**16), temperature=st.sampled_from([0.0, 1.0]))
def test_generated_schemas_are_obeyed(tiny, ll_tokenizer, schema, seed, temperature):
    so = SO(json=schema)
    so.check()
    out = tiny.generate([_prompt(8, seed)], SamplingParams(temperature=temperature, seed=seed, max_tokens=48,
                                                          structured_outputs=so), use_tqdm=False)[0].outputs[0]
    assert_obeys(ll_tokenizer, so, out)
    if out.finish_reason == "stop":
        jsonschema.validate(json.loads(out.text), schema)


# ---- a real model -------------------------------------------------------------------------
def test_24_schemas_with_smollm2_all_parse_and_validate(smollm2_dir):
    llm = LLM(num_blocks=1024)
    names = list(SCHEMAS)
    assert len(names) >= 20
    conversations = [[{"role": "user", "content": f"Reply with JSON that matches this schema: "
                                                  f"{json.dumps(SCHEMAS[n])}"}] for n in names]
    params = [SamplingParams(temperature=0, max_tokens=200, structured_outputs=SO(json=SCHEMAS[n])) for n in names]
    outs = llm.chat(conversations, params, use_tqdm=False)
    for name, out in zip(names, outs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (name, completion.text)
        jsonschema.validate(json.loads(completion.text), SCHEMAS[name])
    assert_engine_idle(llm)
    llm.shutdown()
