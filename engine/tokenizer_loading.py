"""The model's tokenizer, loaded as ``AutoTokenizer`` would, without what it costs for nothing.

``AutoTokenizer.from_pretrained`` first builds the model's transformers config class, and every
one of those imports transformers' model-loading stack (activations, hub kernels, DTensor
sharding, and through ``torch.distributed`` sympy): ~640 modules and ~50 MiB of resident memory
in every process, the engine's own config being plain JSON. A tokenizer saved by transformers 5
(and every model the GGUF converter writes) names ``TokenizersBackend`` in its
``tokenizer_config.json``; for those ``AutoTokenizer`` ends at ``TokenizersBackend`` whatever the
model type, but for the cases it special-cases below, so they are loaded with that class
directly. Everything else goes through ``AutoTokenizer``.

The loaded tokenizer is shared between threads (the API server encodes prompts on one, the
output processor decodes on another): the Rust tokenizer is ``Sync`` and decoding and encoding
only borrow it. What would mutate it is transformers resetting its truncation and padding on an
encode when they differ from the call's (none) - so they are cleared here, once, before any
thread sees it, and no encode in the engine asks for either.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# What tokenizer_config.json names for a plain fast tokenizer (transformers 5 and 4 spellings).
_PLAIN_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(name_or_path: str | Path):
    """The tokenizer ``AutoTokenizer.from_pretrained(name_or_path)`` gives, truncation and
    padding off."""
    tokenizer_class = _plain_fast_class(Path(name_or_path))
    if tokenizer_class is None:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(str(name_or_path))
    else:
        tokenizer = tokenizer_class.from_pretrained(str(name_or_path))
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None:
        backend.no_truncation()
        backend.no_padding()
    return tokenizer


def _plain_fast_class(model_dir: Path):
    """``TokenizersBackend`` where ``AutoTokenizer`` is known to choose it without the model's
    config class; None to ask ``AutoTokenizer``."""
    try:
        tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
        model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
        from transformers import TokenizersBackend
        from transformers.models.auto.tokenization_auto import (
            MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
            TOKENIZER_MAPPING_NAMES,
        )
    except (OSError, ValueError, ImportError):  # a hub name, no such file, another transformers
        return None
    if not isinstance(tokenizer_config, dict) or tokenizer_config.get("tokenizer_class") not in _PLAIN_FAST:
        return None
    if "auto_map" in tokenizer_config:  # remote code: AutoTokenizer's rules for it
        return None
    # AutoTokenizer's two exceptions: a model type whose hub class it overrides with its own, and
    # Mistral's, which may load mistral-common's tokenizer instead.
    registered = (TOKENIZER_MAPPING_NAMES.get(model_type) or "").removesuffix("Fast")
    if model_type in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS or registered == "MistralCommonBackend":
        return None
    return TokenizersBackend
