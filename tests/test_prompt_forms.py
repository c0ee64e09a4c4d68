"""vLLM's prompt, conversation and constructor forms for the offline LLM (issue 33): each valid
form answers what its plain equivalent answers, anything else is refused by name."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from entrypoints.llm_arguments import engine_arguments
from entrypoints.prompt_inputs import parse_conversations, parse_prompts
from tests.conftest import assert_engine_idle

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
PARAMS = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
TEXTS = ["Hello there", "The weather in Paris", "x"]

token_lists = st.lists(st.integers(1, 1000), min_size=1, max_size=6)
plain_prompts = st.one_of(st.text(min_size=1, max_size=8), token_lists)


def forms_of(plain):
    """Every spelling vLLM accepts for one prompt."""
    if isinstance(plain, str):
        return st.sampled_from([plain, {"prompt": plain}])
    return st.sampled_from([plain, tuple(plain), {"prompt_token_ids": plain}, {"prompt_token_ids": tuple(plain)}])


spelled = plain_prompts.flatmap(lambda plain: forms_of(plain).map(lambda form: (plain, form)))

# (A lone int is refused too, but in a list it is a token id.)
not_a_prompt = st.one_of(
    st.none(), st.floats(), st.binary(min_size=1), st.booleans(),
    st.lists(st.booleans(), min_size=1, max_size=3),
    st.lists(st.floats(allow_nan=False), min_size=1, max_size=3),
    st.lists(token_lists, min_size=1, max_size=2).map(lambda x: [x]),  # a list of lists of token lists
    st.lists(st.text(max_size=3), min_size=1, max_size=2).map(lambda x: [x]),  # a list of lists of str
    st.just({}), st.just({"multi_modal_data": None}),
    st.dictionaries(st.text(min_size=1, max_size=5).filter(lambda k: k not in ("prompt", "prompt_token_ids")),
                    st.text(max_size=3), min_size=1, max_size=2),
    st.just({"prompt": 5}), st.just({"prompt_token_ids": "12"}), st.just({"prompt_token_ids": [1.5]}),
    st.just({"prompt": ["a"]}), st.just(iter(["a"])), st.just({"a", "b"}),
)


@SETTINGS
@given(st.lists(spelled, max_size=5), st.booleans())
def test_every_valid_form_parses_to_its_plain_prompt(items, single):
    if single and items:
        plain, form = items[0]
        assert parse_prompts(form) == [plain]
    else:
        assert parse_prompts([form for _, form in items]) == [plain for plain, _ in items]


@SETTINGS
@given(st.lists(spelled, max_size=3), not_a_prompt, st.integers(0, 3), st.booleans())
def test_anything_else_is_a_type_error_naming_the_argument(items, bad, at, alone):
    forms = [form for _, form in items]
    forms.insert(min(at, len(forms)), bad)
    with pytest.raises(TypeError, match=r"prompts"):
        parse_prompts(bad if alone else forms)


def test_a_lone_int_is_not_a_prompt():
    with pytest.raises(TypeError, match="prompts must be"):
        parse_prompts(5)


def test_a_bad_token_id_is_named():
    for bad, where in (([1, True], r"prompts\[1\]"), ([[1, 2], [3, 2.0]], r"prompts\[1\]\[1\]"),
                       ({"prompt_token_ids": [1, None]}, r"prompts\['prompt_token_ids'\]\[1\]")):
        with pytest.raises(TypeError, match=where + ": a token id must be an int"):
            parse_prompts(bad)


def test_vllm_optional_keys_read_as_vllm_does():
    # A TokensPrompt may carry its text for display; None asks for nothing.
    assert parse_prompts({"prompt_token_ids": [1, 2], "prompt": "ab"}) == [[1, 2]]
    assert parse_prompts([{"prompt": "x", "multi_modal_data": None}]) == ["x"]


def test_vllm_keys_this_engine_lacks_are_refused_by_name():
    with pytest.raises(ValueError, match="multi_modal_data is not supported"):
        parse_prompts({"prompt": "describe", "multi_modal_data": {"image": None}})
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt_embeds"):
        parse_prompts(["a", {"prompt_embeds": [[0.5]]}])


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), num_blocks=200, max_model_len=512)


@pytest.fixture(scope="module")
def plain_answers(llm):
    tok = llm.get_tokenizer()
    plain = TEXTS + [tok.encode(t) for t in TEXTS]
    outs = llm.generate(plain, PARAMS, use_tqdm=False)
    return {repr(p): o.outputs[0].token_ids for p, o in zip(plain, outs)}


@pytest.fixture(autouse=True)
def _idle_after(request):
    yield
    if "llm" in request.fixturenames:
        assert_engine_idle(request.getfixturevalue("llm"))


def test_a_single_tokens_prompt_dict_is_that_prompt(llm, plain_answers):
    """The report: a TokensPrompt dict was read as a list of its keys (the text
    "prompt_token_ids") and answered."""
    ids = llm.get_tokenizer().encode(TEXTS[1])
    out = llm.generate({"prompt_token_ids": ids}, PARAMS, use_tqdm=False)
    assert len(out) == 1 and out[0].prompt_token_ids == ids and out[0].prompt is None
    assert out[0].outputs[0].token_ids == plain_answers[repr(ids)]
    listed = llm.generate([{"prompt_token_ids": ids}, {"prompt": TEXTS[0]}], PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in listed] == [plain_answers[repr(ids)], plain_answers[repr(TEXTS[0])]]
    assert listed[1].prompt == TEXTS[0]


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_generated_forms_answer_as_their_plain_prompts(llm, plain_answers, data):
    tok = llm.get_tokenizer()
    bases = TEXTS + [tok.encode(t) for t in TEXTS]
    chosen = data.draw(st.lists(st.sampled_from(bases), min_size=1, max_size=4))
    forms = [data.draw(forms_of(p)) for p in chosen]
    outs = llm.generate(forms if len(forms) > 1 else forms[0], PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [plain_answers[repr(p)] for p in chosen]
    assert [o.prompt for o in outs] == [p if isinstance(p, str) else None for p in chosen]
    assert [o.prompt_token_ids for o in outs] == [tok.encode(p) if isinstance(p, str) else p for p in chosen]


def test_invalid_prompts_and_params_fail_before_anything_runs(llm):
    with pytest.raises(TypeError, match=r"prompts\[1\]"):
        llm.generate(["fine", [["nested"]]], PARAMS, use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params"):
        llm.generate("fine", {"max_tokens": 3}, use_tqdm=False)
    assert llm.engine.get_num_unfinished_requests() == 0


def test_chat_takes_text_parts_and_refuses_others_by_name(llm):
    as_str = llm.chat([{"role": "user", "content": "Hi\nthere"}], PARAMS, use_tqdm=False)[0]
    as_parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}],
                        PARAMS, use_tqdm=False)[0]
    assert as_parts.prompt_token_ids == as_str.prompt_token_ids
    assert as_parts.outputs[0].token_ids == as_str.outputs[0].token_ids
    two = llm.chat(([{"role": "user", "content": "Hi\nthere"}], [{"role": "user", "content": "x"}]), PARAMS,
                   use_tqdm=False)
    assert two[0].outputs[0].token_ids == as_str.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"messages\[0\]\['content'\]\[1\].*'image_url'"):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}], PARAMS)
    with pytest.raises(ValueError, match=r"messages\[1\]\['role'\]"):
        llm.chat([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}], PARAMS)
    for bad in ({"role": "user", "content": "a"}, "Hi", [], [["not a message"]]):
        with pytest.raises(TypeError, match="messages"):
            llm.chat(bad, PARAMS)
    with pytest.raises(TypeError):  # vLLM's 4th positional is lora_request: never read as another option
        llm.chat([{"role": "user", "content": "a"}], PARAMS, False, None)


def test_parse_conversations_keeps_other_message_fields():
    [conversation] = parse_conversations([{"role": "assistant", "content": None, "tool_calls": []}])
    assert conversation == [{"role": "assistant", "content": None, "tool_calls": []}]


def test_vllm_constructor_arguments_are_read_or_refused_by_name():
    assert engine_arguments(dict(tensor_parallel_size=1, enforce_eager=True, trust_remote_code=False,
                                 max_num_batched_tokens=None, dtype="float", seed=3)) == dict(
        enforce_eager=True, dtype="float", seed=3)
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        engine_arguments(dict(tensor_parallel_size=2))
    assert engine_arguments(dict(quantization="int8")) == dict(quantization="int8")  # an EngineConfig field
    with pytest.raises(ValueError, match="quantization must be int4, int8 or gguf.*'awq'"):
        EngineConfig(**engine_arguments(dict(quantization="awq")))
    with pytest.raises(ValueError, match="enforce_eager must be True or False"):
        EngineConfig(**engine_arguments(dict(enforce_eager="yes")))
    with pytest.raises(TypeError, match="unsupported argument.*swap_space.*accepted: .*max_model_len"):
        engine_arguments(dict(swap_space=4))
    with pytest.raises(ValueError, match="kv_events_config: only a served engine"):
        engine_arguments(dict(kv_events_config={"enable_kv_cache_events": True}))


def test_config_reads_vllm_spellings_and_checks_connector_extras():
    import torch

    from engine.config import EngineConfig, KVTransferConfig
    for given, want in ((torch.bfloat16, "bfloat16"), ("torch.float32", "float32"), ("half", "float16"),
                        ("float", "float32"), (torch.float16, "float16")):
        assert EngineConfig(dtype=given).dtype == want
    with pytest.raises(ValueError, match="unknown keys \\['encrypted'\\]"):
        KVTransferConfig.from_dict({"kv_role": "kv_producer", "kv_connector_extra_config": {"encrypted": True}})
    with pytest.raises(ValueError, match="encrypt must be true or false"):
        KVTransferConfig(extra={"encrypt": "false"})
    with pytest.raises(ValueError, match="lease_s must be a positive number"):
        KVTransferConfig(extra={"lease_s": 0})
    assert KVTransferConfig.from_dict({"kv_connector_extra_config": {"lease_s": 5, "encrypt": False}}).extra["lease_s"] == 5


def test_an_llm_built_with_vllm_arguments(tiny_llama):
    llm = LLM(str(tiny_llama), num_blocks=64, max_model_len=256, dtype="float", enforce_eager=False,
              tensor_parallel_size=1, max_num_seqs=None, enable_prefix_caching=False, seed=7,
              kv_transfer_config={"kv_connector": None, "kv_role": "kv_both"})
    try:
        config = llm.engine.config
        assert config.dtype == "float32" and config.max_num_seqs == 256 and config.seed == 7
        assert config.kv_transfer_config.kv_role == "kv_both" and not config.enable_prefix_caching
        assert len(llm.generate("x", PARAMS, use_tqdm=False)[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()
