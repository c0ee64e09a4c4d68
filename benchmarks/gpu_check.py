"""The CUDA check's steps, each a subcommand that prints its table whole (gpu_check.sh runs them
one process each, under a timeout, so one failing step costs only its own table).

    python benchmarks/gpu_check.py models TOKDIR OUTDIR    random-weight Llama checkpoints on the GPU
    python benchmarks/gpu_check.py kernels                 each backend vs torch on generated paged steps
    python benchmarks/gpu_check.py correctness MODEL       engine on CUDA vs engine on CPU (fp32), bf16 vs HF's
    python benchmarks/gpu_check.py throughput MODEL        engine vs HF generate, share of bandwidth / weights
    python benchmarks/gpu_check.py pd MODEL                engine disagg on one GPU vs the offline engine

``--device cpu`` runs a step on the CPU (checks the script itself; no timing claims there).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

SHAPES = {  # Llama-3.2-1B's and SmolLM2-135M's shapes, SmolLM2's vocabulary
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64),
    "small": {},
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- models ------------------------------------------------------------------------------------

def make_models(tokdir: str, outdir: str, device: torch.device) -> None:
    """Random weights (initializer 0.05: peakier logits, fewer near-ties) with the default model's
    tokenizer and config; the 1b one in bf16 (its checkpoint's dtype), the small one in fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM
    base = json.loads(Path(tokdir, "config.json").read_text())
    for name, shape in SHAPES.items():
        cfg = {**base, **shape, "initializer_range": 0.05}
        config = LlamaConfig(**{k: v for k, v in cfg.items() if not k.startswith("_")})
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(config).to(torch.bfloat16 if name == "1b" else torch.float32)
        out = Path(outdir, name)
        model.save_pretrained(out)
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if Path(tokdir, f).exists():
                shutil.copy(Path(tokdir, f), out / f)
        print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters -> {out}", flush=True)
        del model


# ---- kernels -----------------------------------------------------------------------------------

def random_step(device, dtype, heads, kv_heads, head_dim=64, block_size=16, seed=0, decodes=12, prefills=4,
                max_ctx=900, fixed_ctx=None):
    """Decodes and chunked prefills with context, mixed, on shuffled block tables (decodes of
    exactly ``fixed_ctx`` keys when given)."""
    from engine.worker.attention import StepAttention
    rng = random.Random(seed)
    shapes = [(fixed_ctx or rng.randint(1, max_ctx), 1) for _ in range(decodes)] + [
        (rng.randint(0, 600), rng.randint(2, 300)) for _ in range(prefills)]
    rng.shuffle(shapes)
    need = [-(-(c + q) // block_size) for c, q in shapes]
    ids = list(range(1, sum(need) + 8))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    g = torch.Generator().manual_seed(seed)
    tokens = sum(q for _, q in shapes)
    rand = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
    step, _ = StepAttention.from_lists([q for _, q in shapes], [c for c, _ in shapes], tables, block_size, device)
    return step, rand(tokens, heads, head_dim), rand(tokens, kv_heads, head_dim), rand(tokens, kv_heads, head_dim), \
        rand(2, len(ids) + 1, block_size, kv_heads, head_dim)


def time_call(fn, device, iters=20) -> float:
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) / iters * 1e3


def check_kernels(device: torch.device) -> None:
    from engine.worker.backends import try_backend
    from engine.worker.backends.torch_sdpa import TorchSDPABackend
    dtypes = (torch.float32, torch.bfloat16, torch.float16) if device.type == "cuda" else (torch.float32,)
    names = ("triton", "flash_attn", "xformers") if device.type == "cuda" else ("cpu",)
    print("| backend | dtype | heads/kv x dim | window | softcap | probe | max abs diff vs torch | ms/call | "
          "torch ms/call |")
    print("|---|---|---|---|---|---|---|---|---|")
    variants = ((None, None), (128, None), (None, 30.0))
    cases = [(shape, dtype, variant) for shape in ((32, 8, 64), (9, 3, 64)) for dtype in dtypes for variant in variants]
    cases += [(shape, dtypes[min(1, len(dtypes) - 1)], (None, None)) for shape in ((32, 8, 128), (16, 8, 256))]
    for (heads, kv_heads, head_dim), dtype, (window, softcap) in cases:
        step, q, k, v, cache = random_step(device, dtype, heads, kv_heads, head_dim)
        ref = TorchSDPABackend()
        meta = ref.build_metadata(step, window)
        want = ref.forward(q, k, v, cache.clone(), meta, 0.125, softcap).float()
        ref_ms = time_call(lambda: ref.forward(q, k, v, cache, ref.build_metadata(step, window), 0.125,
                                               softcap), device)
        for name in names:
            row = f"| {name} | {str(dtype)[6:]} | {heads}/{kv_heads} x {head_dim} | {window} | {softcap} |"
            try:
                backend, why = try_backend(name, device, dtype, 16, head_dim, softcap, heads, kv_heads, (window,))
                if backend is None:
                    print(f"{row} skipped: {why} | | | {ref_ms:.3f} |", flush=True)
                    continue
                got = backend.forward(q, k, v, cache.clone(), backend.build_metadata(step, window), 0.125,
                                      softcap).float()
                ms = time_call(lambda: backend.forward(q, k, v, cache, backend.build_metadata(step, window),
                                                       0.125, softcap), device)
                print(f"{row} passed | {(got - want).abs().max().item():.2e} | {ms:.3f} | {ref_ms:.3f} |",
                      flush=True)
            except Exception as exc:
                print(f"{row} FAILED {type(exc).__name__}: {str(exc)[:200]} | | | |", flush=True)
    # Decode-only steps, as the graphs run them: long contexts, many rows. Timed 20 calls at a
    # time, so a call's launch overhead (~0.1 ms from Python) is in the number: a lower bound of
    # what the kernel can show, not the kernel alone.
    print("\n| decode step (keys each) | split-K segments | triton ms | triton ms unsplit | torch ms |")
    print("|---|---|---|---|---|")
    for rows, ctx in ((1, 4096), (1, 32768), (32, 1024), (256, 256)):
        step, q, k, v, cache = random_step(device, torch.bfloat16 if device.type == "cuda" else torch.float32, 32,
                                           8, decodes=rows, prefills=0, fixed_ctx=ctx, seed=1)
        ref = TorchSDPABackend()
        backend, why = try_backend("triton" if device.type == "cuda" else "torch", device, q.dtype, 16, 64, None,
                                   32, 8)
        if backend is None:
            print(f"| {rows} x ~{ctx} | {why} | | | |")
            continue
        meta, rmeta = backend.build_metadata(step, None), ref.build_metadata(step, None)
        whole = dataclasses.replace(meta, num_splits=1) if hasattr(meta, "num_splits") else meta
        want = ref.forward(q, k, v, cache.clone(), rmeta, 0.125).float()
        diff = (backend.forward(q, k, v, cache.clone(), meta, 0.125).float() - want).abs().max().item()
        t = time_call(lambda: backend.forward(q, k, v, cache, meta, 0.125), device)
        t1 = time_call(lambda: backend.forward(q, k, v, cache, whole, 0.125), device)
        r = time_call(lambda: ref.forward(q, k, v, cache, rmeta, 0.125), device)
        print(f"| {rows} x {ctx} | {getattr(meta, 'num_splits', 1)} (max diff {diff:.1e}) | {t:.3f} | {t1:.3f} | "
              f"{r:.3f} |", flush=True)


# ---- correctness -------------------------------------------------------------------------------

def prompt_lps(out, ids):
    return torch.tensor([float(d[ids[i]].logprob) for i, d in enumerate(out.prompt_logprobs or []) if d is not None])


def engine_run(model, prompts, **kwargs):
    from engine import LLM, SamplingParams
    llm = LLM(model, num_blocks=1024, **kwargs)
    backend = llm.engine.runner.backend.name
    graphs = llm.engine.runner.graphs is not None
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=0)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    result = [(prompt_lps(o, p), list(o.outputs[0].token_ids)) for o, p in zip(outs, prompts)]
    llm.shutdown()
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return f"{backend}{'+graphs' if graphs else ''}", result, elapsed


def hf_lps(model, prompts, dtype, device):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    res = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            lp = torch.log_softmax(m(x).logits[0].float(), -1)
            res.append(lp[:-1].gather(1, x[0, 1:, None])[:, 0].cpu())
    del m
    return res


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_correctness(model: str, device: torch.device) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(n)] for n in (17, 100, 333, 1200)]
    _, cpu, el = engine_run(model, prompts, device="cpu", dtype="float32", attention_backend="torch")
    print(f"reference: the engine on the CPU, float32, torch backend ({el:.1f}s)")
    print("| device | dtype | backend asked | backend run | max abs dlogprob vs CPU fp32 (per prompt) | "
          "greedy tokens equal (of 24, per prompt) | s |")
    print("|---|---|---|---|---|---|---|")
    runs = [("float32", "auto", {}), ("float32", "triton", {"enforce_eager": True}), ("float32", "torch", {}),
            ("bfloat16", "auto", {}), ("float16", "auto", {}), ("bfloat16", "torch", {})]
    engine_bf16 = None
    for dtype, backend, extra in runs:
        try:
            name, res, el = engine_run(model, prompts, device=str(device), dtype=dtype, attention_backend=backend,
                                       **extra)
            d = " ".join(f"{(a - c[0]).abs().max():.1e}" for (a, _), c in zip(res, cpu))
            eq = [first_diff(t, c[1]) for (_, t), c in zip(res, cpu)]
            print(f"| {device.type} | {dtype} | {backend}{' eager' if extra else ''} | {name} | {d} | {eq} | "
                  f"{el:.2f} |", flush=True)
            if dtype == "bfloat16" and backend == "auto":
                engine_bf16 = [a for a, _ in res]
        except Exception as exc:
            print(f"| {device.type} | {dtype} | {backend} | FAILED | {type(exc).__name__}: {str(exc)[:300]} | | |",
                  flush=True)
            traceback.print_exc()
    if engine_bf16 is not None:
        hf32 = hf_lps(model, prompts, torch.float32, device)
        hf16 = hf_lps(model, prompts, torch.bfloat16, device)
        print("\n| prompt tokens | HF fp32 vs engine CPU fp32 | HF bf16 vs HF fp32 | engine bf16 vs HF fp32 |")
        print("|---|---|---|---|")
        for p, a, b, e, c in zip(prompts, hf32, hf16, engine_bf16, cpu):
            print(f"| {len(p)} | {(a - c[0]).abs().max():.1e} | {(b - a).abs().max():.2e} (mean "
                  f"{(b - a).abs().mean():.2e}) | {(e - a).abs().max():.2e} (mean {(e - a).abs().mean():.2e}) |")


# ---- throughput --------------------------------------------------------------------------------

def bandwidth(device) -> float:
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = time_call(lambda: y.copy_(x), device, iters=10)
    del x, y
    return 2 * 2 * 1024**3 / (ms / 1e3)  # bytes read + written per second


def workloads(quick: bool):
    r = random.Random(0)
    p = lambda n: [r.randrange(100, 49000) for _ in range(n)]  # noqa: E731
    if quick:
        return {"single": [(p(16), 8)], "b32": [(p(16), 4) for _ in range(4)]}
    return {"single 128->512": [(p(128), 512)], "32 x (128->256)": [(p(128), 256) for _ in range(32)],
            "256 x (128->128)": [(p(128), 128) for _ in range(256)]}


def run_hf(hf, work, device, cap=None):
    """HF generate, batched (256 a batch), left-padded, greedy; ``cap``: generate at most that many
    tokens per request (the single stream: HF at ~20 tok/s would take the whole budget)."""
    start = time.perf_counter()
    tokens = 0
    with torch.inference_mode():
        for i in range(0, len(work), 256):
            b = work[i:i + 256]
            width = max(len(p) for p, _ in b)
            new = max(m for _, m in b) if cap is None else min(cap, max(m for _, m in b))
            ids = torch.zeros((len(b), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, (p, _) in enumerate(b):
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=0)
            tokens += new * len(b)
    sync(device)
    return tokens / (time.perf_counter() - start)


def check_throughput(model: str, device: torch.device, quick: bool, backends: list[str]) -> None:
    from engine import LLM, SamplingParams
    from transformers import AutoModelForCausalLM
    bw = bandwidth(device) if device.type == "cuda" else float("nan")
    print(f"device copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    work = workloads(quick)
    engines = {}
    rates = {}
    for backend in backends:
        eager = backend.endswith("-eager")
        name = backend.removesuffix("-eager")
        start = time.perf_counter()
        llm = LLM(model, device=str(device), dtype="bfloat16" if device.type == "cuda" else "float32",
                  attention_backend=name, enforce_eager=eager)
        runner = llm.engine.runner
        label = f"{runner.backend.name}{'+graphs' if runner.graphs is not None else ''}"
        print(f"engine {backend}: {label}, loaded in {time.perf_counter() - start:.1f}s, "
              f"{runner.num_blocks} KV blocks", flush=True)
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        llm.generate([{"prompt_token_ids": list(range(100, 164))}] * 4, SamplingParams(max_tokens=8, ignore_eos=True),
                     use_tqdm=False)
        for wname, w in work.items():
            start = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p, _ in w],
                                [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in w],
                                use_tqdm=False)
            elapsed = time.perf_counter() - start
            assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(m for _, m in w)
            rates[(backend, wname)] = sum(m for _, m in w) / elapsed
        engines[backend] = label
        llm.shutdown()
        del llm, runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                                              attn_implementation="sdpa").to(device).eval()
    run_hf(hf, [(list(range(100, 164)), 4)] * 2, device)
    hf_rates = {wname: run_hf(hf, w, device, cap=128 if len(w) == 1 else None) for wname, w in work.items()}
    del hf
    head = " | ".join(f"engine {b} ({engines[b]}) tok/s" for b in backends)
    print(f"\n| workload | {head} | HF generate tok/s | first engine / HF |")
    print("|---|" + "---|" * len(backends) + "---|---|")
    for wname in work:
        cells = " | ".join(f"{rates[(b, wname)]:.0f}" for b in backends)
        print(f"| {wname} | {cells} | {hf_rates[wname]:.0f} | {rates[(backends[0], wname)] / hf_rates[wname]:.2f}x |")
    single = next(iter(work))
    limit = bw / 2 / weight_bytes  # reads per second of the weights at the device's read rate
    for b in backends:
        print(f"single stream, {b}: {rates[(b, single)]:.0f} tok/s = {rates[(b, single)] / limit:.1%} of the "
              f"bandwidth limit ({bw / 2 / 1e12:.2f} TB/s read / {weight_bytes / 1e9:.2f} GB of weights = "
              f"{limit:.0f} tok/s)")


# ---- P->D on one GPU ---------------------------------------------------------------------------

def check_pd(model: str, device: torch.device) -> None:
    from engine import LLM, SamplingParams
    log = Path(os.environ.get("OUT") or tempfile.gettempdir(), "pd_disagg.log")
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 49000) for _ in range(n)] for n in (40, 700, 1500, 3000)]
    port = 8011
    cmd = [sys.executable, "-m", "entrypoints.cli", "disagg", model, "--device", device.type, "--dtype", "float32",
           "--port", str(port), "--max-local-prefill-tokens", "0"]
    if device.type == "cpu":
        cmd += ["--kv-cache-memory", "1GiB"]
    print("$", " ".join(cmd[2:]), flush=True)
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)

    def post(body):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        return json.load(urllib.request.urlopen(req, timeout=120))
    served = []
    try:
        start = time.time()
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
                break
            except Exception:
                if proc.poll() is not None or time.time() - start > 150:
                    print("engine disagg did not come up:\n", log.read_text()[-3000:])
                    return
                time.sleep(1)
        print(f"engine disagg up in {time.time() - start:.0f}s")
        for p in prompts:
            t = time.time()
            r = post({"model": model, "prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                      "return_token_ids": True})
            served.append(r["choices"][0].get("token_ids"))
            print(f"P->D prompt of {len(p)} tokens: {time.time() - t:.2f}s", flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    budget_lines = [line for line in log.read_text().splitlines() if "KV cache budget" in line or "captured" in line]
    print("\n".join(budget_lines[:4]))
    llm = LLM(model, device=device.type, dtype="float32", num_blocks=1024)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    # The same prompts through a CPU tier on the GPU: saved from device memory (pinned, off the
    # step's stream), then loaded back by a second engine that shares no GPU blocks with it.
    tier_dir = tempfile.mkdtemp(prefix="gpu-check-tier-")
    tiered = []
    for _ in range(2):
        with LLM(model, device=device.type, dtype="float32", num_blocks=1024,
                 kv_store=f"disk:{tier_dir}:2GiB") as tier_llm:
            tiered.append(tier_llm.generate([{"prompt_token_ids": p} for p in prompts],
                                            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                            use_tqdm=False))
    shutil.rmtree(tier_dir, ignore_errors=True)
    print("| prompt tokens | P->D tokens equal the offline engine's | disk tier save, then load: equal |")
    print("|---|---|---|")
    for p, o, s, t in zip(prompts, outs, served, tiered[1]):
        print(f"| {len(p)} | {list(o.outputs[0].token_ids) == s} | "
              f"{list(o.outputs[0].token_ids) == list(t.outputs[0].token_ids)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["models", "kernels", "correctness", "throughput", "pd"])
    parser.add_argument("args", nargs="*")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny workloads (checks the script itself)")
    parser.add_argument("--backends", default="auto,auto-eager,torch-eager",
                        help="throughput: the engine's attention backends to compare (-eager: no CUDA graphs)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.step == "models":
        make_models(args.args[0], args.args[1], device)
    elif args.step == "kernels":
        check_kernels(device)
    elif args.step == "correctness":
        check_correctness(args.args[0], device)
    elif args.step == "throughput":
        check_throughput(args.args[0], device, args.quick, args.backends.split(","))
    else:
        check_pd(args.args[0], device)


if __name__ == "__main__":
    main()
