from setuptools import find_packages, setup

setup(
    name="engine",
    version="0.1.0",
    description="A self-contained LLM inference engine: paged KV cache, continuous batching, "
    "disaggregated prefill and KV cache tiers.",
    python_requires=">=3.10",
    packages=find_packages(include=["engine", "engine.*", "entrypoints", "entrypoints.*"]),
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
    ],
    extras_require={
        "test": ["pytest>=8", "openai>=1.40", "pytest-timeout", "matplotlib", "hypothesis>=6.170,<7",
                 "schemathesis==4.32.5", "jsonschema>=4"],
        "cuda": ["flash-attn", "xformers"],
    },
    entry_points={"console_scripts": ["engine = entrypoints.cli:main"]},
)
