"""--prefix-caching-hash-algo: vLLM's block hashes in the KV events, pinned to values computed by
vLLM's documented algorithm (vllm/utils/hashing.py, vllm/v1/core/kv_cache_utils.py)."""
from __future__ import annotations

import hashlib
import pickle

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.vllm_block_hash import VllmBlockHasher, external, hash_function, none_hash

# PYTHONHASHSEED=0, block size 4: the first two blocks of [1..9], unsalted and salted "tenant-a",
# as 64-bit event hashes. Computed once with the algorithm written out in `_reference` below.
PINNED = {
    ("sha256", None): [10362225831949560093, 12472515041799373675],
    ("sha256_cbor", None): [2164874634404590027, 17270480062156288726],
    ("sha256", "tenant-a"): [7454133266969187146, 15176314846481461753],
    ("sha256_cbor", "tenant-a"): [13195198002585232116, 802162569614849407],
}
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 9]


def _reference(algorithm: str, seed: str, tokens: list[int], block_size: int, salt: str | None) -> list[int]:
    """vLLM's chain, written from its source: H = sha256(pickle protocol 5) or sha256(canonical
    CBOR); NONE_HASH = H(seed); block i: H((parent, tuple(tokens), extra_keys)), extra_keys =
    (salt,) on the first block of a salted request, else None; events carry the low 64 bits."""
    serialize = ((lambda v: pickle.dumps(v, protocol=5)) if algorithm == "sha256"
                 else (lambda v: cbor2.dumps(v, canonical=True)))
    digest = lambda v: hashlib.sha256(serialize(v)).digest()  # noqa: E731
    parent, out = digest(seed), []
    for i in range(len(tokens) // block_size):
        parent = digest((parent, tuple(tokens[i * block_size:(i + 1) * block_size]),
                         (salt,) if i == 0 and salt else None))
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


@pytest.mark.parametrize("algorithm,salt", list(PINNED))
def test_pinned_hashes(algorithm, salt, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    hasher = VllmBlockHasher(algorithm, 4)
    assert hasher.prompt_hashes(TOKENS, salt) == PINNED[(algorithm, salt)]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(algorithm=st.sampled_from(["sha256", "sha256_cbor"]), block_size=st.sampled_from([1, 2, 16]),
       tokens=st.lists(st.integers(0, 2**31 - 1), max_size=50), salt=st.none() | st.text(min_size=1, max_size=8),
       seed=st.sampled_from(["0", "42", "ü"]), split=st.integers(0, 50))
def test_request_hashes_equal_the_reference_however_tokens_arrive(algorithm, block_size, tokens, salt, seed, split):
    """A request's hashes, computed as its tokens arrive one by one after a prompt, are the
    chain a router computes for the whole sequence."""
    hasher = VllmBlockHasher(algorithm, block_size, root=hash_function(algorithm)(seed))
    prompt, rest = tokens[:split] or tokens[:1], tokens[split:] if split else tokens[1:]
    if not prompt:
        return
    request = Request("r", prompt, SamplingParams(), frozenset(), 100, hasher, cache_salt=salt)
    for token in rest:
        request.append_output_token_id(token)
    expected = _reference(algorithm, seed, tokens, block_size, salt)
    assert request.event_block_hashes == expected == hasher.prompt_hashes(tokens, salt)


def test_no_seed_is_random_per_process(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert none_hash("sha256", None) != none_hash("sha256", None)
    assert VllmBlockHasher("sha256", 4).prompt_hashes(TOKENS) != VllmBlockHasher("sha256", 4).prompt_hashes(TOKENS)


def test_a_reported_root_is_used_as_is():
    """A router builds its hasher from the root an instance reports (its /status)."""
    root = hash_function("sha256_cbor")("0")
    assert VllmBlockHasher("sha256_cbor", 4, root=root).prompt_hashes(TOKENS) == PINNED[("sha256_cbor", None)]


def test_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="sha256_cbor"):
        hash_function("xxhash")


def test_external_is_the_low_64_bits():
    assert external(bytes(range(32))) == int.from_bytes(bytes(range(24, 32)), "big")
