"""How often a preemption changes a request's greedy output, by dtype.

The same batch of chat-style prompts runs twice: in a KV pool that never runs short, and in one
so small that the scheduler preempts (recompute). For each preempted request it reports whether
its output is identical up to its first preemption and whether it is identical as a whole.

    python benchmarks/preemption_drift.py --dtype auto       # bf16 where the CPU has it natively
    python benchmarks/preemption_drift.py --dtype float32

Defaults: the default model, 24 prompts of 96 greedy tokens, a pool of 24 blocks of 16 tokens.
"""
from __future__ import annotations

import argparse
import logging
import random
import time

from engine import LLM, SamplingParams

TOPICS = ["the history of Rome", "how photosynthesis works", "a recipe for bread", "why the sky is blue",
          "the rules of chess", "how a compiler works", "the water cycle", "the life of a honeybee",
          "how to learn a language", "the causes of the first world war", "what a black hole is",
          "how vaccines work", "the plot of Hamlet", "how to train for a marathon", "how the internet works",
          "the French revolution", "how a car engine works", "the solar system", "how money is created",
          "the theory of evolution", "how to write a poem", "the Industrial Revolution", "what DNA does",
          "how airplanes fly", "the Roman alphabet", "how rain forms", "what an atom is", "how bees make honey"]


def prompts(n: int) -> list[str]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        notes = " ".join(rng.choice(TOPICS) for _ in range(rng.randrange(0, 12)))
        out.append(f"Some notes: {notes}. Write a short essay about {TOPICS[i % len(TOPICS)]}.")
    return out


def run(args, num_blocks: int, batch: list[str]) -> tuple[list[list[int]], dict[str, int], list[str], str]:
    """Token ids per prompt, and the output tokens each preempted request had at its first preemption."""
    llm = LLM(args.model, dtype=args.dtype, num_blocks=num_blocks, block_size=16)
    scheduler = llm.engine.scheduler
    preempted_at: dict[str, int] = {}
    preempt = scheduler._preempt
    scheduler._preempt = lambda request: (preempted_at.setdefault(request.request_id, request.num_output_tokens),
                                          preempt(request))
    start = time.perf_counter()
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True),
                        use_tqdm=False)
    dtype = str(llm.engine.runner.dtype).removeprefix("torch.")
    print(f"{num_blocks} blocks: {time.perf_counter() - start:.1f} s, {scheduler.stats.num_preemptions} preemptions")
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], preempted_at, [o.request_id for o in outs], dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the engine's default model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-blocks", type=int, default=24, help="the small pool (blocks of 16 tokens)")
    args = parser.parse_args()
    logging.getLogger("engine.scheduler").setLevel(logging.ERROR)  # one warning per preemption otherwise
    batch = prompts(args.prompts)
    want, _, _, _ = run(args, 4096, batch)
    got, preempted_at, ids, dtype = run(args, args.num_blocks, batch)
    prefix_same = whole_same = 0
    first_diffs = []
    for tokens, expected, req_id in zip(got, want, ids):
        if req_id not in preempted_at:
            assert tokens == expected, f"request {req_id} was never preempted, yet its output changed"
            continue
        at = preempted_at[req_id]
        prefix_same += tokens[:at] == expected[:at]
        whole_same += tokens == expected
        if tokens != expected:
            first_diffs.append((at, next(i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b)))
    n = len(preempted_at)
    print(f"{dtype}: {n} of {len(batch)} requests preempted; identical up to the first preemption: {prefix_same}/{n}; "
          f"identical as a whole: {whole_same}/{n}")
    if first_diffs:
        print("  (output tokens at the first preemption, first differing token):", sorted(first_diffs))


if __name__ == "__main__":
    main()
