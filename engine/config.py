"""Engine configuration: plain dataclasses, validated on creation."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from engine.cpu_placement import check_placement
from engine.kv_events import KVEventsConfig, parse_kv_events_config
from engine.vllm_block_hash import hash_function
from engine.kv_transfer.secret import KVSecret, load_kv_secret

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a string such as "2GiB", "512MB" or "1e9"."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, (int, float)):
        size = int(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if match is None or match.group(2).lower() not in _SIZE_UNITS:
            raise ValueError(f"not a size: {value!r} (use e.g. 2GiB, 512MiB or a byte count)")
        size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return size


@dataclass
class CacheConfig:
    block_size: int = 16
    # Exactly one of the two sizes the pool; neither means the device default.
    num_blocks: int | None = None
    kv_cache_memory: int | str | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise ValueError(f"num_blocks must be a positive integer, got {self.num_blocks!r}")
        if self.num_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("num_blocks and kv_cache_memory are exclusive: give one of them")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_size(self.kv_cache_memory)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # max_model_len is resolved against the model by EngineConfig.
    max_model_len: int = 0
    # vLLM's: a prefill computes at most this many tokens per step (0: up to the step's budget),
    # so the decodes sharing its steps keep a short inter-token latency.
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        value = self.long_prefill_token_threshold
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"long_prefill_token_threshold must be 0 (off) or a positive integer, got {value!r}")


# kv_connector_extra_config: each key and the type its value must have (a typo such as
# "encrypted" must not leave KV unencrypted).
KV_EXTRA_TYPES = {"lease_s": (int, float), "load_timeout_s": (int, float), "encrypt": (bool,)}


def check_kv_extra(extra: object) -> None:
    if not isinstance(extra, dict):
        raise ValueError(f"kv_connector_extra_config must be an object, got {type(extra).__name__}")
    unknown = sorted(set(extra) - KV_EXTRA_TYPES.keys())
    if unknown:
        raise ValueError(f"kv_connector_extra_config: unknown keys {unknown}; known: {sorted(KV_EXTRA_TYPES)}")
    for key, value in extra.items():
        types = KV_EXTRA_TYPES[key]
        if not isinstance(value, types) or (bool not in types and (isinstance(value, bool) or
                                                                    not math.isfinite(value) or value <= 0)):
            kind = "true or false" if bool in types else "a positive number"
            raise ValueError(f"kv_connector_extra_config.{key} must be {kind}, got {value!r}")


def check_kv_ip(kv_ip: object) -> None:
    """The address a prefill binds its KV port to is also the one it tells decode instances to
    connect to: it must be a real IPv4 address or host name."""
    import ipaddress

    if not isinstance(kv_ip, str) or not kv_ip or kv_ip == "*":
        raise ValueError(f"kv_ip must be an IPv4 address or a host name, got {kv_ip!r}")
    try:
        address = ipaddress.ip_address(kv_ip.strip("[]"))
    except ValueError:
        return  # a host name
    if address.version == 6:
        raise ValueError(f"kv_ip {kv_ip}: IPv6 KV addresses are not supported yet; use an IPv4 address or a host name")
    if address.is_unspecified:
        raise ValueError(f"kv_ip {kv_ip} is not an address decode instances can connect to: pass --kv-ip with "
                         "this host's address on the network they use")


@dataclass
class KVTransferConfig:
    """Which connector moves KV in and out of this instance (see engine/kv_transfer)."""
    kv_connector: str | None = None
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"
    kv_port: int | None = None
    kv_load_failure_policy: str = "recompute"
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict) -> KVTransferConfig:
        """vLLM's kv_transfer_config dict (``kv_connector_extra_config`` is our ``extra``);
        a key this engine does not know is refused by name."""
        raw = dict(raw)
        extra = raw.pop("kv_connector_extra_config", None)
        extra = raw.pop("extra", None) if extra is None else extra
        extra = {} if extra is None else extra  # anything but an object is refused by check_kv_extra
        known = {"kv_connector", "kv_role", "kv_ip", "kv_port", "kv_load_failure_policy"}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**raw, extra=extra)

    def __post_init__(self) -> None:
        check_kv_extra(self.extra)
        check_kv_ip(self.kv_ip)
        if self.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(f"kv_role must be kv_producer, kv_consumer or kv_both, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError(
                f"kv_load_failure_policy must be recompute or fail, got {self.kv_load_failure_policy!r}")


# vLLM's other names for the dtypes (a torch.dtype given is read by its name).
DTYPE_ALIASES = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


ATTENTION_BACKENDS = ("auto", "triton", "cpu", "torch", "flash_attn", "xformers")


@dataclass
class EngineConfig:
    model: str | None = None  # a local directory, a .gguf file or a Hugging Face id
    revision: str | None = None  # of a Hugging Face id: a branch, tag or commit
    download_dir: str | None = None  # the Hugging Face cache to use (default: HF_HOME's)
    tokenizer: str | None = None
    dtype: str = "auto"
    # Weights kept quantized (engine/worker/quantized.py): None runs a .gguf's Q4_0/Q4_1/Q8_0
    # tensors as stored and a float checkpoint in dtype; "int4" | "int8" quantize a float
    # checkpoint at load; "gguf" (vLLM's name) asks for a .gguf as stored.
    quantization: str | None = None
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | str | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0  # see SchedulerConfig
    attention_backend: str = "auto"  # auto | triton | cpu | torch | flash_attn | xformers
    # Steps of up to 4 rows of a bfloat16 model (a few streams decoding) read a plain copy of the
    # linear weights with a native kernel, on CPUs with AVX512-BF16 (engine/worker/cpu_linear.py):
    # faster there than oneDNN; its rows then differ in their last bits from those of larger
    # steps (outputs may change with batching at near-ties). Off by default.
    small_rows_linear: bool = False
    # The share of the GPU's memory this instance may hold in all: weights, activations, CUDA
    # graphs and KV (CUDA; kv_cache_memory, when given, sizes the KV instead).
    gpu_memory_utilization: float = 0.9
    # CUDA graphs of decode steps (engine/worker/cuda_graphs.py) off: every step runs eagerly.
    enforce_eager: bool = False
    max_capture_size: int = 256  # the largest decode batch captured (at most max_num_seqs)
    kv_transfer_config: KVTransferConfig | None = None
    # KV cache tiers, fastest first: "cpu:4GiB,disk:/var/cache/engine-kv:20GiB,redis://host:6379/0".
    kv_store: str | None = None
    kv_chunk_tokens: int = 256  # tokens per stored chunk, a multiple of block_size
    kv_store_ttl_s: int = 24 * 3600  # Redis entries expire after this long without a write
    # Load every tier hit (the default), even where this instance's measured rates say recomputing
    # it is faster; False: the load-or-recompute decision (engine/kv_transfer/load_cost.py). Off by
    # default: with a small model or a fast device, recompute beats even a local read, and whether
    # a hit is used would then depend on timings.
    kv_always_load: bool = True
    # The deployment secret (engine/kv_transfer/secret.py): a file holding it, or the secret
    # itself; neither given: $ENGINE_KV_SECRET, else none (KV plane open to this host only).
    kv_secret_file: str | None = None
    kv_secret: KVSecret | bytes | str | None = field(default=None, repr=False)
    # CPU placement of the model's process (engine/cpu_placement.py): the cores it may use
    # (a list, or a spec like "0-3,6") and torch's thread count (default with cores given: one
    # per physical core among them; with neither, torch's own).
    cpu_cores: list[int] | str | None = None
    num_threads: int | None = None
    # Core lending on one host (engine/core_lending.py), for a served engine: a prefill instance
    # lends its cpu_cores while idle and says so through this file; a decode instance borrows
    # the cores of the instance writing that file while it is idle.
    lend_cores_file: str | None = None
    borrow_cores_file: str | None = None
    # KV events for routers (engine/kv_events.py): vLLM's --kv-events-config, a dict or JSON.
    kv_events_config: KVEventsConfig | dict | str | None = None
    # What the KV events name blocks by (engine/vllm_block_hash.py): None, the engine's own
    # fingerprint-rooted hashes; "sha256" | "sha256_cbor", vLLM's (for routers that compute them).
    prefix_caching_hash_algo: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.kv_transfer_config, dict):
            self.kv_transfer_config = KVTransferConfig.from_dict(self.kv_transfer_config)
        elif self.kv_transfer_config is not None and not isinstance(self.kv_transfer_config, KVTransferConfig):
            raise TypeError(f"kv_transfer_config must be a KVTransferConfig or a dict, "
                            f"got {type(self.kv_transfer_config).__name__}")
        self.cpu_cores = check_placement(self.cpu_cores, self.num_threads)
        if self.lend_cores_file and self.borrow_cores_file:
            raise ValueError("an instance lends its cores (lend_cores_file) or borrows (borrow_cores_file), not both")
        if (self.lend_cores_file or self.borrow_cores_file) and self.cpu_cores is None:
            raise ValueError("core lending needs the instance's own cores: cpu_cores")
        self.kv_events_config = parse_kv_events_config(self.kv_events_config)
        if self.prefix_caching_hash_algo is not None:
            hash_function(self.prefix_caching_hash_algo)  # ValueError naming the choices
            if self.kv_events_config is None:
                raise ValueError("prefix_caching_hash_algo names the blocks of the KV events: it needs them on "
                                 "(--kv-events)")
        name = str(self.dtype).removeprefix("torch.")  # a torch.dtype is read by its name
        self.dtype = DTYPE_ALIASES.get(name, name)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not isinstance(self.small_rows_linear, bool):
            raise ValueError(f"small_rows_linear must be true or false, got {self.small_rows_linear!r}")
        if self.quantization not in (None, "gguf", "int4", "int8"):
            raise ValueError(f"quantization must be int4, int8 or gguf (a .gguf model), got {self.quantization!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.kv_chunk_tokens, int) or self.kv_chunk_tokens < 1 or \
                self.kv_chunk_tokens % self.block_size:
            raise ValueError(f"kv_chunk_tokens must be a positive multiple of block_size ({self.block_size}), "
                             f"got {self.kv_chunk_tokens!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}")
        if type(self.max_capture_size) is not int or self.max_capture_size < 0:
            raise ValueError(f"max_capture_size must be a non-negative integer, got {self.max_capture_size!r}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not isinstance(self.kv_always_load, bool):
            raise ValueError(f"kv_always_load must be True or False, got {self.kv_always_load!r}")
        if not isinstance(self.kv_store_ttl_s, int) or self.kv_store_ttl_s < 1:
            raise ValueError(f"kv_store_ttl_s must be a positive integer, got {self.kv_store_ttl_s!r}")
        if self.kv_secret is None:
            self.kv_secret = load_kv_secret(self.kv_secret_file)
        elif not isinstance(self.kv_secret, KVSecret):
            self.kv_secret = KVSecret(self.kv_secret)
        self.cache = CacheConfig(self.block_size, self.num_blocks, self.kv_cache_memory, self.enable_prefix_caching)
        self.scheduler = SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens,
                                         long_prefill_token_threshold=self.long_prefill_token_threshold)
