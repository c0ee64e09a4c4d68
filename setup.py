import os
import platform
import sys

from setuptools import find_packages, setup


def native_extensions() -> tuple[list, dict]:
    """The CPU kernels of csrc/cpu, built once per ISA (engine/worker/native.py loads the one
    the CPU runs, and falls back to torch with a log line when none is there). Needs torch at
    build time: the Makefile installs it first and runs pip with --no-build-isolation. A build
    without torch (an isolated build, or ENGINE_NO_NATIVE=1) installs the pure-torch engine."""
    if os.environ.get("ENGINE_NO_NATIVE") == "1":
        return [], {}
    if platform.machine().lower() not in ("x86_64", "amd64"):
        print("engine: no native CPU kernels for", platform.machine(), "(the torch path runs)", file=sys.stderr)
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("engine: torch is not importable at build time, so the native CPU kernels are not built "
              "(install torch first and use pip install --no-build-isolation -e .)", file=sys.stderr)
        return [], {}
    common = ["-O3", "-std=c++17", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]
    isas = {"avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
            "avx2": ["-mavx2", "-mfma", "-mf16c"]}
    extensions = [
        CppExtension(f"engine._C_{isa}", [f"csrc/cpu/isa/{isa}.cpp"], extra_compile_args=common + flags,
                     extra_link_args=["-fopenmp"])
        for isa, flags in isas.items()]
    return extensions, {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = native_extensions()
OTEL = ["opentelemetry-api>=1.26", "opentelemetry-sdk>=1.26", "opentelemetry-exporter-otlp-proto-http>=1.26"]

setup(
    name="engine",
    version="0.1.0",
    description="A self-contained LLM inference engine: paged KV cache, continuous batching, "
    "disaggregated prefill and KV cache tiers.",
    python_requires=">=3.10",
    packages=find_packages(include=["engine", "engine.*", "entrypoints", "entrypoints.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    install_requires=[
        # torch is pinned by the Makefile before this install (the CPU wheel on this disk);
        # a looser range here never pulls a second build.
        "torch>=2.4",
        "transformers>=4.45",
        "tokenizers>=0.21",
        "safetensors",
        "gguf>=0.10",
        "numpy",
        "pyzmq>=25",
        "msgspec",
        "tqdm",
        "jinja2",
        "fastapi",
        "uvicorn",
        "pydantic>=2",
        "prometheus_client",
        "httpx",
        "redis>=5",
        "hiredis",  # redis-py's C reply parser: large KV values parse without holding the GIL for long
        # Structured output (JSON schema, regex, choice, grammar): a 3 MB wheel, no torch or triton pin.
        "llguidance>=1.0,<2",
        # vLLM's sha256_cbor block hashes for the KV events (--prefix-caching-hash-algo).
        "cbor2>=5",
    ],
    extras_require={
        # triton: its interpreter runs the CUDA path's Triton kernels on CPU (TRITON_INTERPRET=1).
        # opentelemetry: the tracing tests export spans to a receiver of their own.
        "test": ["pytest>=8", "openai>=1.40", "pytest-timeout", "matplotlib", "hypothesis>=6.170,<7",
                 "schemathesis==4.32.5", "jsonschema>=4", "triton>=3.6", *OTEL],
        # --otlp-traces-endpoint (entrypoints/tracing.py): spans over OTLP/HTTP.
        "otel": OTEL,
        "cuda": ["flash-attn", "xformers"],
        "ray": ["ray[serve]==2.60.0"],
    },
    entry_points={"console_scripts": ["engine = entrypoints.cli:main"]},
)
