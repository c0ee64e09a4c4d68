"""The offline workloads of benchmarks/throughput.py and benchmarks/peers.py: (prompt token
ids, max_tokens) pairs. Standard library only, so the peer's own venv can import it."""
from __future__ import annotations

import random

WORKLOADS = ("uniform", "varied", "single")
# Long contexts (benchmarks/peers.py runs them too): 8 prompts of ~3,500 tokens -> 128 new each,
# and one stream decoding 256 tokens after a 6,000-token prompt. They need max_model_len 8192.
LONG_WORKLOADS = ("long", "long-single")
# Not run unless named: long-prefill, long's prompts with one new token each (its prefill alone).


def make_workload(name: str, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    if name == "uniform":
        return [(prompt(128), 64) for _ in range(32)]
    if name == "varied":
        return [(prompt(rng.randint(10, 400)), rng.randint(8, 256)) for _ in range(64)]
    if name == "single":
        return [(prompt(128), 256)]
    if name == "long":
        return [(prompt(rng.randint(3400, 3600)), 128) for _ in range(8)]
    if name == "long-prefill":  # long's prompts with one new token each: its prefill alone
        return [(p, 1) for p, _ in make_workload("long", vocab, seed)]
    if name == "long-single":
        return [(prompt(6000), 256)]
    raise ValueError(name)
