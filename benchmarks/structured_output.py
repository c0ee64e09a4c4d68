"""Structured output: what a grammar costs per token, and how long grammars take to compile.

    python benchmarks/structured_output.py [--model PATH] [--batch 32] [--max-tokens 64] [--rounds 3]

Decode cost: the same batch of chat prompts, each generating exactly --max-tokens tokens, once
free and once under a JSON schema that cannot finish earlier (an array of at least 20 records),
interleaved for --rounds rounds in one process; prints output tokens/s of each and the ratio,
and how much of a constrained step the bitmask took (scheduler side). Compile: every schema of
tests/structured_schemas.py compiled cold (a new matcher each) and then from the engine's
cache, plus the edge check the API server runs on each request.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llguidance  # noqa: E402

import engine.scheduler as scheduler_module  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.structured_output import StructuredOutputsParams  # noqa: E402
from tests.structured_schemas import SCHEMAS  # noqa: E402

LONG_SCHEMA = {"type": "array", "minItems": 20, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"]}}


class BitmaskTimer:
    """Wraps the scheduler's build_bitmask to add up the time it takes."""

    def __init__(self) -> None:
        self.seconds, self.calls, self._inner = 0.0, 0, scheduler_module.build_bitmask
        scheduler_module.build_bitmask = self

    def __call__(self, *args):
        start = time.perf_counter()
        try:
            return self._inner(*args)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def decode_rates(llm: LLM, batch: int, max_tokens: int, rounds: int) -> None:
    conversations = [[{"role": "user", "content": f"List {20 + i} people with their ages as JSON."}]
                     for i in range(batch)]
    free = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=LONG_SCHEMA))
    llm.chat(conversations[:2], [free, constrained], use_tqdm=False)  # warm-up, and the compile
    timer = BitmaskTimer()
    times = {"free": [], "constrained": []}
    for _ in range(rounds):
        for name, params in (("free", free), ("constrained", constrained)):
            masked_before = timer.seconds
            start = time.perf_counter()
            outs = llm.chat(conversations, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs), "an output ended early"
            times[name].append(elapsed)
            if name == "constrained":
                print(f"  constrained round: {elapsed:.2f}s, of which bitmasks {timer.seconds - masked_before:.3f}s")
            else:
                print(f"  free round: {elapsed:.2f}s")
    tokens = batch * max_tokens
    best = {name: min(values) for name, values in times.items()}
    print(f"\n| batch {batch} x {max_tokens} tokens | free | constrained |\n|---|---|---|")
    print(f"| best round, s | {best['free']:.2f} | {best['constrained']:.2f} |")
    print(f"| output tok/s | {tokens / best['free']:.1f} | {tokens / best['constrained']:.1f} |")
    print(f"constrained / free time per token: {best['constrained'] / best['free']:.3f}x "
          f"(medians {statistics.median(times['constrained']) / statistics.median(times['free']):.3f}x); "
          f"bitmask {1e3 * timer.seconds / max(timer.calls, 1):.2f} ms per step over {timer.calls} steps")


def compile_times(llm: LLM) -> None:
    compiler = llm.engine.grammar_compiler
    start = time.perf_counter()
    compiler.request_grammar(StructuredOutputsParams(json_object=True))._compiled.result()
    print(f"\nfirst use (tokenizer tables, once per engine) + one grammar: {time.perf_counter() - start:.2f}s")
    tokenizer = compiler._ll_tokenizer
    cold, check, cached = [], [], []
    for schema in SCHEMAS.values():
        params = StructuredOutputsParams(json=schema)
        start = time.perf_counter()
        params.check()
        check.append(time.perf_counter() - start)
        start = time.perf_counter()
        llguidance.LLMatcher(tokenizer, params.grammar_spec(), log_level=0)
        cold.append(time.perf_counter() - start)
        compiler.request_grammar(params)._compiled.result()
        start = time.perf_counter()
        grammar = compiler.request_grammar(params)
        grammar.ready()
        grammar._get_matcher()
        cached.append(time.perf_counter() - start)
    ms = lambda xs: f"{1e3 * statistics.median(xs):.2f} / {1e3 * max(xs):.2f}"  # noqa: E731
    print(f"\n| {len(SCHEMAS)} schemas, ms (median / max) | |\n|---|---|")
    print(f"| edge check (API server, no tokenizer) | {ms(check)} |")
    print(f"| compile (engine core, its own thread) | {ms(cold)} |")
    print(f"| cached: a request's own matcher | {ms(cached)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(args.model, num_blocks=2048, max_num_seqs=args.batch)
    compile_times(llm)
    decode_rates(llm, args.batch, args.max_tokens, args.rounds)
    llm.shutdown()


if __name__ == "__main__":
    main()
