"""The front end's half of the engine (engine/output_processor.py) on its own, with the engine
core as a neighbour faked by hand-made EngineCoreOutputs, and with a real core: text is made
outside the core, stop strings stop the core's sequence at once, one request's failure there
ends only that request, and a prefill instance's answer made final by a stop string withdraws
its offer and keeps a signed, offer-free hand-off."""
from __future__ import annotations

import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from engine import LLM, SamplingParams
from engine.kv_transfer.first_token import hand_off_params
from engine.kv_transfer.params import KVTransferParams, check_kv_transfer_params_signature, token_digest
from engine.kv_transfer.secret import KVSecret
from engine.output_processor import OutputKind, OutputProcessor
from engine.outputs import EngineCoreOutput
from tests.conftest import assert_engine_idle


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_engine_core_process_makes_no_text(tiny_llama):
    """The core's outputs are token ids: its process never loads the detokenizer or the
    output processor (they run beside the client)."""
    code = ("import sys\nfrom engine.config import EngineConfig\nfrom engine.engine_core import EngineCore\n"
            "from engine import SamplingParams\n"
            "core = EngineCore(EngineConfig(model=sys.argv[1], num_blocks=16))\n"
            "core.add_request('r', [5, 6, 7], SamplingParams(max_tokens=3, temperature=0))\n"
            "outs = []\nwhile core.has_unfinished_requests():\n    outs += core.step()\n"
            "assert [len(o.new_token_ids) for o in outs] == [1, 1, 1], outs\n"
            "assert not hasattr(outs[0], 'text')\n"
            "bad = [m for m in ('engine.detokenizer', 'engine.output_processor') if m in sys.modules]\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code, str(tiny_llama)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_stop_string_stops_the_core_at_once_and_hides_what_follows(tokenizer):
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=50, stop=["world"])
    processor.add_request("r", None, ids(tokenizer, "Say:"), params, OutputKind.FINAL_ONLY)
    tokens = ids(tokenizer, " hello world and more")
    processed = processor.process([EngineCoreOutput("r", tokens[:1])])
    assert processed.outputs == [] and processed.stop == []
    # The core sampled past the stop string in the same step: none of it is shown.
    processed = processor.process([EngineCoreOutput("r", tokens[1:])])
    assert processed.stop == ["r"]
    (out,) = processed.outputs
    assert out.finished and out.outputs[0].text == " hello " and out.outputs[0].stop_reason == "world"
    # Whatever the core still sends for it is dropped: the request is done here.
    assert processor.process([EngineCoreOutput("r", [5])]).outputs == [] and processor.num_tracked_requests() == 0


def test_one_requests_failure_ends_only_that_request(tokenizer, monkeypatch):
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=5)
    for rid in ("good", "bad"):
        processor.add_request(rid, None, [5, 6], params, OutputKind.FINAL_ONLY)
    bad = processor._requests["bad"].sequences["bad"].detok

    def explode(token_ids):
        raise Exception("tokenizers says no")  # what a tokenizer raises: a plain Exception
    monkeypatch.setattr(bad, "update", explode)
    processed = processor.process([EngineCoreOutput("good", [100], finish_reason="length"),
                                   EngineCoreOutput("bad", [100])])
    assert processed.abort == ["bad"]
    by_id = {o.request_id: o for o in processed.outputs}
    assert by_id["good"].outputs[0].finish_reason == "length" and by_id["good"].error is None
    assert by_id["bad"].outputs[0].finish_reason == "error" and "tokenizers says no" in by_id["bad"].error


def test_a_prefill_answer_made_final_by_a_stop_string_keeps_its_offer_without_first_tokens(tokenizer):
    """P's core hands off (the first token did not end the sequence there), but the front end
    finds a stop string in it: the answer is final for this client. The KV stays on offer (a
    vLLM-style router sends D the client's own request next) and the parameters lose the first
    tokens (sampled with the router's parameters: D samples its own), signed again with the same
    expiry."""
    secret = KVSecret(b"s" * 32)
    processor = OutputProcessor(tokenizer, secret)
    prompt = ids(tokenizer, "Count:")
    first = ids(tokenizer, " one")[0]
    offer = KVTransferParams(do_remote_prefill=True, remote_kv_addr="tcp://127.0.0.1:5555", remote_request_id="p",
                             num_tokens=len(prompt), token_digest=token_digest(prompt))
    signed = hand_off_params(offer, prompt, [first], [None], secret, 30.0)
    processor.add_request("p", None, prompt, SamplingParams(max_tokens=10, stop=[tokenizer.decode([first])]),
                          OutputKind.FINAL_ONLY)
    processed = processor.process([EngineCoreOutput("p", [first], finish_reason="handed_off",
                                                     kv_transfer_params=signed)])
    (out,) = processed.outputs
    assert out.outputs[0].finish_reason == "stop"
    params = out.kv_transfer_params
    assert params.do_remote_prefill and params.remote_request_id == "p" and params.token_digest == offer.token_digest
    assert params.first_token_ids is None and params.first_tokens_digest is None and params.first_logprobs is None
    assert params.expires_at == signed.expires_at
    check_kv_transfer_params_signature(params, secret)  # raises if it does not verify


def test_a_continuing_hand_off_keeps_its_offer(tokenizer):
    processor = OutputProcessor(tokenizer)
    prompt = [5, 6, 7]
    offer = KVTransferParams(do_remote_prefill=True, remote_kv_addr="tcp://127.0.0.1:5555", remote_request_id="p",
                             num_tokens=3, token_digest=token_digest(prompt))
    signed = hand_off_params(offer, prompt, [100], [None], None, 30.0)
    processor.add_request("p", None, prompt, SamplingParams(max_tokens=10), OutputKind.FINAL_ONLY)
    processed = processor.process([EngineCoreOutput("p", [100], finish_reason="handed_off", kv_transfer_params=signed)])
    assert processed.outputs[0].kv_transfer_params == signed
    assert processed.outputs[0].outputs[0].finish_reason is None  # not finished for the client


@pytest.mark.parametrize("ending", ["continues", "stop string", "length"])
def test_a_decode_shows_only_first_tokens_the_proxy_did_not(tokenizer, ending):
    """On a decode instance whose client was shown the prefill's first tokens: a sequence that
    goes on was shown its first token (the deltas go on after it); one that ends with its first
    token was not (the proxy shows only the sequences the prefill's answer left open), so its
    text goes out whole. (The differential suite found the second case answered '', n=2.)"""
    processor = OutputProcessor(tokenizer)
    first = ids(tokenizer, " lighted")
    stop = ["ted"] if ending == "stop string" else []
    max_tokens = 1 if ending == "length" else 5
    processor.add_request("d", None, [5, 6], SamplingParams(max_tokens=max_tokens, stop=stop), OutputKind.DELTA,
                          first_tokens_shown=True)
    finish = "length" if ending == "length" else None
    (out,) = processor.process([EngineCoreOutput("d", first[:1], finish_reason=finish, from_prefill=True)]).outputs
    if ending == "continues":
        # Nothing new for the client: no chunk (a single instance's stream has none), and the
        # shown token goes with the next delta, counted in the usage but not shown again.
        assert out.outputs == []
        up = ids(tokenizer, " up")
        (out,) = processor.process([EngineCoreOutput("d", up)]).outputs
        assert out.outputs[0].token_ids == first + up and out.outputs[0].token_ids_shown == len(first)
        assert out.outputs[0].text == " up" and out.outputs[0].finish_reason is None
    else:
        text = out.outputs[0].text
        whole = tokenizer.decode(first[:1])
        assert text == (whole.split("ted")[0] if stop else whole) and text
        assert out.outputs[0].finish_reason == ("stop" if stop else "length")


def test_stop_strings_end_sequences_in_the_core_for_a_real_engine(tiny_llama):
    llm = LLM(str(tiny_llama), num_blocks=64)
    reference = llm.generate([[11, 12, 13]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    stop = reference.text[len(reference.text) // 2:][:3]
    assert stop.strip(), reference.text
    engine = llm.engine
    engine.add_request("s", [11, 12, 13], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))
    done = []
    while not done:
        done = [o for o in engine.step() if o.finished]
    assert done[0].outputs[0].finish_reason == "stop" and stop not in done[0].outputs[0].text
    assert not engine.scheduler.requests  # stopped in the core in the same step
    assert_engine_idle(llm)


def test_a_sequence_id_in_use_refuses_the_request_that_would_take_it(tokenizer):
    """A client's id "0_v" is sequence 0 of "v" with n=2: whichever comes second is refused
    before anything is registered, so the first one's outputs keep reaching it."""
    from engine.errors import InvalidRequestError
    for first, second in ((("0_v", 1), ("v", 2)), (("v", 2), ("0_v", 1))):
        processor = OutputProcessor(tokenizer)
        processor.add_request(first[0], None, [5, 6], SamplingParams(n=first[1], max_tokens=2), OutputKind.FINAL_ONLY)
        with pytest.raises(InvalidRequestError, match="in use"):
            processor.add_request(second[0], None, [5, 6], SamplingParams(n=second[1], max_tokens=2),
                                  OutputKind.FINAL_ONLY)
        seqs = ["0_v"] if first[1] == 1 else ["0_v", "1_v"]
        outs = processor.process([EngineCoreOutput(s, [100, 101], finish_reason="length") for s in seqs]).outputs
        assert [o.request_id for o in outs] == [first[0]] and processor.num_tracked_requests() == 0


def test_logprob_offsets_continue_past_shown_first_tokens_in_any_step_split(tokenizer):
    """On a decode instance the shown first token and the next one may come in one step (a
    prompt fully cached there): the offsets still continue past the first token's string."""
    tokens = ids(tokenizer, " Paris is big")
    strings = [tokenizer.decode([t]) for t in tokens]
    entries = [[(t, -0.5, 1)] for t in tokens]
    processor = OutputProcessor(tokenizer)
    processor.add_request("d", None, [5, 6], SamplingParams(max_tokens=10, logprobs=0), OutputKind.DELTA,
                          first_tokens_shown=True)
    (out,) = processor.process([EngineCoreOutput("d", tokens[:1], [entries[0]], from_prefill=True),
                                EngineCoreOutput("d", tokens[1:2], [entries[1]])]).outputs
    assert out.outputs[0].text_offset == len(strings[0]) and list(out.outputs[0].logprobs[0]) == [tokens[1]]
    (out,) = processor.process([EngineCoreOutput("d", tokens[2:3], [entries[2]])]).outputs
    assert out.outputs[0].text_offset == len(strings[0]) + len(strings[1])
