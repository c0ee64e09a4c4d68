"""`engine generate | serve | proxy | bench`."""
from __future__ import annotations

import argparse
import logging
import sys


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by every subcommand that builds an engine (names follow vllm serve)."""
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--kv-cache-memory", default=None,
                      help="bytes of KV cache, e.g. 2GiB (default: 2GiB on CPU)")
    size.add_argument("--num-blocks", type=int, default=None, help="size the KV cache by a block count")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="max requests per step (default 256)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="token budget per step; longer prompts are prefilled in chunks (default 2048)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length (default: the model's max_position_embeddings)")
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        help="disable automatic prefix caching")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights and KV dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory, num_blocks=args.num_blocks,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
                dtype=args.dtype, device=args.device, seed=args.seed)


def cmd_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sampling_seed)
    if args.chat:
        output = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    else:
        output = llm.generate(args.prompt, params, use_tqdm=False)[0]
    print(output.outputs[0].text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="engine", description="LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="print a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
