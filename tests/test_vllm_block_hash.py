"""--prefix-caching-hash-algo: vLLM's block hashes in the KV events, held to hashes real vLLM 0.32
computed (tests/fixtures/vllm_block_hash/hashes.json, from capture.py beside it: vLLM's own
init_none_hash and request block hasher), and, where the peer venv exists, to live vLLM."""
from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.vllm_block_hash import VllmBlockHasher, external, hash_function, none_hash
from tests.server_utils import REPO
from tests.test_vllm_kv_events import NO_PEER, PEER_PYTHON, run_in_peer

FIXTURE = json.loads((REPO / "tests" / "fixtures" / "vllm_block_hash" / "hashes.json").read_text())
CASES = [(key, name) for key, result in FIXTURE["results"].items() for name in result["cases"]]


def _set_seed(monkeypatch, key: str) -> str:
    """PYTHONHASHSEED as the fixture's key says (``ALGO/unset`` or ``ALGO/PYTHONHASHSEED=S``); the algorithm."""
    algorithm, seed = key.split("/")
    if seed == "unset":
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed.split("=", 1)[1])
    return algorithm


def test_the_fixture_is_vllm_0_32s():
    assert FIXTURE["captured_with"]["vllm"] == "0.32.0"
    assert {key.split("/")[1] for key in FIXTURE["results"]} == {"unset", "PYTHONHASHSEED=0"}


@pytest.mark.parametrize("key", list(FIXTURE["results"]))
def test_the_root_is_vllms(key, monkeypatch):
    """NONE_HASH as vLLM's init_none_hash makes it: H(PYTHONHASHSEED), and without one the fixed
    H("vllm-none-hash") (so every process, the engine's and a router's, computes the same)."""
    algorithm = _set_seed(monkeypatch, key)
    assert VllmBlockHasher(algorithm, 16).none_hash.hex() == FIXTURE["results"][key]["none_hash"]
    result = FIXTURE["results"][key]
    seed = None if result["none_hash_seed"] == "vllm-none-hash" else result["none_hash_seed"]
    assert none_hash(algorithm, seed).hex() == result["none_hash"]


@pytest.mark.parametrize("key,name", CASES)
def test_hashes_are_the_ones_vllm_computed(key, name, monkeypatch):
    """A router's hashes of the whole sequence, and a request's as its prompt is hashed and its
    outputs arrive one by one (the engine core's path), equal vLLM's: the 64-bit forms the events
    carry and the full hash each next block chains from. Salted cases: vLLM's tagged
    ("cache_salt", salt) extra key."""
    algorithm = _set_seed(monkeypatch, key)
    case = FIXTURE["results"][key]["cases"][name]
    tokens, block_size, salt, prompt_len = case["token_ids"], case["block_size"], case["cache_salt"], case["prompt_len"]
    hasher = VllmBlockHasher(algorithm, block_size)
    assert hasher.prompt_hashes(tokens, salt) == case["event_hashes"]
    request = Request("r", tokens[:prompt_len], SamplingParams(), frozenset(), 1000, hasher, cache_salt=salt)
    for token in tokens[prompt_len:]:
        request.append_output_token_id(token)
    assert request.event_block_hashes == case["event_hashes"]
    assert request.event_parent_hash.hex() == case["block_hashes"][-1]
    assert [external(bytes.fromhex(h)) for h in case["block_hashes"]] == case["event_hashes"]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(algorithm=st.sampled_from(["sha256", "sha256_cbor"]), block_size=st.sampled_from([1, 2, 16]),
       tokens=st.lists(st.integers(0, 2**31 - 1), max_size=50), salt=st.none() | st.text(min_size=1, max_size=8),
       seed=st.sampled_from(["0", "42", "ü"]), split=st.integers(0, 50))
def test_request_hashes_equal_the_whole_sequences_however_tokens_arrive(algorithm, block_size, tokens, salt, seed,
                                                                        split):
    """A request's hashes, computed as its tokens arrive one by one after a prompt, are the chain
    a router computes for the whole sequence (which the tests above and below hold to vLLM's)."""
    hasher = VllmBlockHasher(algorithm, block_size, root=hash_function(algorithm)(seed))
    prompt, rest = tokens[:split] or tokens[:1], tokens[split:] if split else tokens[1:]
    if not prompt:
        return
    request = Request("r", prompt, SamplingParams(), frozenset(), 100, hasher, cache_salt=salt)
    for token in rest:
        request.append_output_token_id(token)
    assert request.event_block_hashes == hasher.prompt_hashes(tokens, salt)
    assert len(request.event_block_hashes) == len(tokens) // block_size


def test_a_reported_root_is_used_as_is(monkeypatch):
    """A hasher built from a root given to it ignores this process's PYTHONHASHSEED."""
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    case = FIXTURE["results"]["sha256_cbor/PYTHONHASHSEED=0"]
    hasher = VllmBlockHasher("sha256_cbor", 4, root=bytes.fromhex(case["none_hash"]))
    assert hasher.prompt_hashes(case["cases"]["tiny"]["token_ids"]) == case["cases"]["tiny"]["event_hashes"]


def test_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="sha256_cbor"):
        hash_function("xxhash")


def test_external_is_the_low_64_bits():
    assert external(bytes(range(32))) == int.from_bytes(bytes(range(24, 32)), "big")


# Run by the peer's python: vLLM's own root and request block hasher on each case from stdin
# ([algorithm, PYTHONHASHSEED or null, block size, tokens, salt, prompt length]); prints the
# 64-bit event hashes of each.
VLLM_HASHES = """
import json, os, sys
from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request
out = []
for algorithm, seed, block_size, tokens, salt, prompt_len in json.load(sys.stdin):
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed
    hash_fn = get_hash_fn_by_name(algorithm)
    kv_cache_utils.init_none_hash(hash_fn)
    request = Request("r", tokens[:prompt_len], SamplingParams(max_tokens=1000), None, cache_salt=salt,
                      block_hasher=kv_cache_utils.get_request_block_hasher(block_size, hash_fn))
    for token in tokens[prompt_len:]:
        request.append_output_token_ids(token)
    out.append([kv_cache_utils.maybe_convert_block_hash(h) for h in request.block_hashes])
print(json.dumps(out))
"""


@pytest.mark.skipif(not PEER_PYTHON.exists(), reason=NO_PEER)
def test_hashes_equal_live_vllms(monkeypatch):
    """Random sequences, block sizes, salts and seeds (unset too): vLLM 0.32 itself, run in the
    peer venv, computes the engine's hashes."""
    rng = random.Random(0)
    cases = []
    for i in range(40):
        tokens = [rng.randrange(2**31) if rng.random() < 0.2 else rng.randrange(50_000)
                  for _ in range(rng.randrange(1, 90))]
        cases.append([("sha256", "sha256_cbor")[i % 2], (None, None, "0", "1234")[i % 4], rng.choice([1, 4, 16]),
                      tokens, rng.choice([None, "s", "tenant-☃", "x" * 40]), rng.randrange(1, len(tokens) + 1)])
    expected = json.loads(run_in_peer(VLLM_HASHES, json.dumps(cases)))
    for (algorithm, seed, block_size, tokens, salt, prompt_len), vllm_hashes in zip(cases, expected):
        if seed is None:
            monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        else:
            monkeypatch.setenv("PYTHONHASHSEED", seed)
        hasher = VllmBlockHasher(algorithm, block_size)
        request = Request("r", tokens[:prompt_len], SamplingParams(), frozenset(), 1000, hasher, cache_salt=salt)
        for token in tokens[prompt_len:]:
            request.append_output_token_id(token)
        assert request.event_block_hashes == hasher.prompt_hashes(tokens, salt) == vllm_hashes, (algorithm, seed, salt)
