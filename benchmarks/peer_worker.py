"""One side of benchmarks/peers.py: loads a model once into this engine or vLLM, then runs the
workloads it is sent, one JSON line per command on stdin, one JSON line per answer on stdout.

    python benchmarks/peer_worker.py --side ours|vllm --model DIR --dtype float32 --threads 2

Runs under the project's venv (ours) or the peer's own venv (vllm); imports only the side's
library and benchmarks/workloads.py, which needs nothing but the standard library.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workloads import make_workload  # noqa: E402

MAX_MODEL_LEN = 8192  # the long workloads' 6,000-token prompt fits


def load_ours(args):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch

    from engine import LLM, SamplingParams
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory=f"{args.kv_gib}GiB", enable_prefix_caching=False,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=MAX_MODEL_LEN,
              small_rows_linear=args.small_rows_linear)

    def generate(work):
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in work]
        outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    return generate, llm.engine.vocab_size


def load_vllm(args):
    # Both cores for compute, as for ours (vLLM's default keeps one for its front end).
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_gib))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(args.model, dtype=args.dtype, max_model_len=MAX_MODEL_LEN, seed=0, enable_prefix_caching=False,
              max_num_batched_tokens=args.max_num_batched_tokens)

    def generate(work):
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in work]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in work], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    return generate, llm.llm_engine.model_config.get_vocab_size()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", choices=["ours", "vllm"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--kv-gib", type=int, default=2)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--small-rows-linear", action="store_true", help="ours: LLM(small_rows_linear=True)")
    args = parser.parse_args()
    generate, vocab = (load_ours if args.side == "ours" else load_vllm)(args)
    generate([(p, 8) for p, _ in make_workload("uniform", vocab, seed=99)[:4]])  # first-call costs
    print(json.dumps({"ready": True, "vocab": vocab}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        work = make_workload(cmd["workload"], vocab, seed=cmd.get("seed", 0))
        start = time.perf_counter()
        tokens = generate(work)
        elapsed = time.perf_counter() - start
        assert [len(t) for t in tokens] == [m for _, m in work], "a request stopped early"
        print(json.dumps({"seconds": elapsed, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
