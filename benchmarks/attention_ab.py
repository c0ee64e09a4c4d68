"""The native CPU paged attention of this tree against the same kernel at another git revision,
interleaved in one process (this machine is noisy: only interleaved ratios count).

Both csrc/cpu trees are compiled with this machine's ISA flags as two extensions with their own
op namespaces (engine_base, engine_this), then each prefill shape is timed alternately and the
ratio printed with the largest difference between their outputs.

    python benchmarks/attention_ab.py --base HEAD~1 [--tokens 512 2048 4096] [--decode-contexts 2048 6000]
                                      [--reps 5] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

REPO = Path(__file__).resolve().parent.parent
FLAGS = ["-O3", "-std=c++17", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-mavx512f", "-mavx512bw",
         "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"]


def build(name: str, csrc: Path, work: Path):
    src = work / f"{name}.cpp"
    src.write_text(f"#define ENGINE_EXT_NAME {name}\n#define ENGINE_OPS_NS {name}\n#include \"{csrc}/ops.cpp\"\n")
    (work / name).mkdir()
    load(name=name, sources=[str(src)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], build_directory=str(work / name),
         is_python_module=False)
    return getattr(torch.ops, name).paged_attention


def prefill_case(tokens: int, dtype: torch.dtype, heads=9, kv_heads=3, head_dim=64, block_size=16):
    """One request's whole prompt (SmolLM2's attention shape by default) over shuffled blocks."""
    g = torch.Generator().manual_seed(0)
    blocks = tokens // block_size + 2
    k = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    table = (torch.randperm(blocks - 1, generator=g)[:-(-tokens // block_size)] + 1).to(torch.int32).view(1, -1)
    return q, k, v, table, torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32)


def decode_case(context: int, dtype: torch.dtype, requests: int = 8, heads=9, kv_heads=3, head_dim=64,
                block_size=16):
    """A decode step: ``requests`` single-token queries, each over ``context`` cached tokens."""
    g = torch.Generator().manual_seed(1)
    per = -(-(context + 1) // block_size)
    blocks = requests * per + 1
    k = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(requests, heads, head_dim, generator=g).to(dtype)
    table = (torch.randperm(blocks - 1, generator=g) + 1).to(torch.int32).view(requests, per)
    return (q, k, v, table, torch.arange(requests + 1, dtype=torch.int32),
            torch.full((requests,), context + 1, dtype=torch.int32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="git revision to compare this tree against")
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--decode-contexts", type=int, nargs="*", default=[2048, 6000],
                        help="also a decode step of 8 requests over this many cached tokens each")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="attention-ab-") as tmp:
        work = Path(tmp)
        base_src = work / "base_csrc"
        base_src.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.base, "csrc/cpu"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base_src), "--strip-components=2"], input=archive, check=True)
        ops = {"base": build("engine_base", base_src, work), "this": build("engine_this", REPO / "csrc/cpu", work)}
        print(f"| dtype | case | {args.base} ms | this tree ms | speed-up | max abs diff |")
        print("|---|---|---|---|---|---|")
        cases = [(f"prefill {n}", prefill_case, n) for n in args.tokens]
        cases += [(f"decode 8 x {n}", decode_case, n) for n in args.decode_contexts]
        for dtype in (torch.float32, torch.bfloat16):
            for label, make, tokens in cases:
                q, k, v, table, query_start, seq_lens = make(tokens, dtype)
                times, outs = {name: [] for name in ops}, {}
                for _ in range(args.reps):
                    for name, op in ops.items():  # alternated, so drift hits both alike
                        out = torch.empty_like(q)
                        start = time.perf_counter()
                        op(out, q, k, v, table, query_start, seq_lens, q.shape[-1] ** -0.5, 0.0, 0)
                        times[name].append(time.perf_counter() - start)
                        outs[name] = out.float()
                base, this = (statistics.median(times[n]) * 1e3 for n in ("base", "this"))
                diff = (outs["this"] - outs["base"]).abs().max().item()
                print(f"| {str(dtype)[6:]} | {label} | {base:.2f} | {this:.2f} | {base / this:.2f}x | {diff:.1e} |",
                      flush=True)


if __name__ == "__main__":
    main()
