"""One side of benchmarks/gguf_peers.py: loads a model once, into this engine or into llama.cpp
(llama-cpp-python), then runs the measurements it is sent, one JSON line per command on stdin,
one JSON line per answer on stdout.

    python benchmarks/gguf_peer_worker.py --side ours|llama_cpp --model PATH [--dtype D]
                                          [--quantization int4|int8] --threads 2

Greedy decoding, EOS ignored, on both sides. llama.cpp's batched decoding of several streams uses
its own batch API (one sequence id per stream, one token each per step), as its server does.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

CONTEXT = 2048  # tokens per stream on llama.cpp's side; its KV cache holds 8x this (16,384)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def load_ours(args):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch

    from engine import LLM, SamplingParams
    torch.set_num_threads(args.threads)
    before = rss_bytes()
    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, kv_cache_memory=f"{args.kv_mib}MiB",
              enable_prefix_caching=False, max_model_len=CONTEXT)
    loaded = time.perf_counter() - start

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    runner = llm.engine.core.runner
    return generate, llm.engine.vocab_size, loaded, rss_bytes() - before, runner.num_blocks * runner.bytes_per_block


def load_llama_cpp(args):
    import llama_cpp
    import numpy as np
    before = rss_bytes()
    start = time.perf_counter()
    # The high-level Llama loads the model; the context is made here, for 8 sequences (its
    # constructor has no n_seq_max), one unified KV cache of 8 x CONTEXT tokens.
    llm = llama_cpp.Llama(args.model, n_ctx=256, n_threads=args.threads, verbose=False)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 8 * CONTEXT, 512, 512, 8
    params.n_threads = params.n_threads_batch = args.threads
    ctx = llama_cpp.llama_init_from_model(llm.model, params)
    if not ctx:
        raise RuntimeError("llama_init_from_model failed")
    loaded = time.perf_counter() - start
    vocab = llm.n_vocab()
    batch = llama_cpp.llama_batch_init(512, 0, 8)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits), at most 512."""
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        if (code := llama_cpp.llama_decode(ctx, batch)) != 0:
            raise RuntimeError(f"llama_decode failed ({code})")

    def argmax(i: int) -> int:
        logits = np.ctypeslib.as_array(ctypes.cast(llama_cpp.llama_get_logits_ith(ctx, i),
                                                   ctypes.POINTER(ctypes.c_float)), shape=(vocab,))
        return int(logits.argmax())

    def generate(prompts: list[list[int]], max_tokens: int, model=llm) -> list[list[int]]:
        # (model: the Llama object stays alive as long as this function: ctx is its raw pointer)
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        out: list[list[int]] = [[] for _ in prompts]
        for seq, prompt in enumerate(prompts):  # prefill, 512 tokens per call
            for at in range(0, len(prompt), 512):
                chunk = prompt[at:at + 512]
                decode([(t, at + i, seq, at + i == len(prompt) - 1) for i, t in enumerate(chunk)])
            out[seq].append(argmax(len(chunk) - 1))
        for _ in range(max_tokens - 1):  # one token per stream per step, all streams in one batch
            decode([(o[-1], len(p) + len(o) - 1, seq, True) for seq, (p, o) in enumerate(zip(prompts, out))])
            for seq, o in enumerate(out):
                o.append(argmax(seq))
        return out
    meta = llm.metadata
    arch = meta["general.architecture"]
    kv_dim = int(meta[f"{arch}.embedding_length"]) // int(meta[f"{arch}.attention.head_count"]) * \
        int(meta[f"{arch}.attention.head_count_kv"])
    kv_bytes = 8 * CONTEXT * int(meta[f"{arch}.block_count"]) * 2 * kv_dim * 2  # K and V, f16
    return generate, vocab, loaded, rss_bytes() - before, kv_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", choices=["ours", "llama_cpp"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--kv-mib", type=int, default=360)  # 16,384 tokens of the default model, as llama.cpp's
    args = parser.parse_args()
    generate, vocab, load_s, rss, kv_bytes = (load_ours if args.side == "ours" else load_llama_cpp)(args)
    generate([[1, 2, 3, 4]], 4)  # first-call costs
    print(json.dumps({"ready": True, "vocab": vocab, "load_s": load_s, "rss_bytes": rss, "kv_bytes": kv_bytes}),
          flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        start = time.perf_counter()
        tokens = generate(cmd["prompts"], cmd["max_tokens"])
        print(json.dumps({"seconds": time.perf_counter() - start, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
