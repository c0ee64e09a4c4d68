"""The prompt and conversation forms the offline API takes: vLLM's, and nothing else.

``LLM.generate`` takes a single prompt or a list (or tuple) of prompts, a prompt being a str, a
list of token ids, ``{"prompt": str}`` (vLLM's ``TextPrompt``) or ``{"prompt_token_ids": [...]}``
(``TokensPrompt``); either dict may carry vLLM's ``"cache_salt"`` (a non-empty str: its KV is
shared only with prompts of the same salt). Only a list or tuple is ever read as several prompts, and only after its items
were each found to be a prompt: a dict is never iterated into its keys, a string never into its
characters. Anything else is a ``TypeError`` that names the argument and lists the forms.
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

from engine.block_pool import check_cache_salt
from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class SaltedPrompt:
    """A prompt dict's prompt with its ``cache_salt``."""
    prompt: str | list[int]
    cache_salt: str


PromptInput = str | list[int] | SaltedPrompt

PROMPT_FORMS = ('a str, a list of token ids, {"prompt": str}, {"prompt_token_ids": [int, ...]}, '
                'or a list of these')
# Keys of vLLM's prompt dicts that this engine does not implement: refused by name, never dropped.
# (None asks for nothing, as vLLM reads it.)
UNSUPPORTED_PROMPT_KEYS = frozenset({
    "multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "media_io_kwargs", "prompt_embeds",
    "token_type_ids", "encoder_prompt", "decoder_prompt"})
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


def _is_token_id(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _token_ids(value: object, where: str) -> list[int] | None:
    """value as a list of token ids, or None when it is not one (bools are not token ids). An
    empty list is an empty prompt, which the engine refuses as such; a list of token ids with
    something else among them is a TypeError naming that element."""
    if not isinstance(value, (list, tuple)):
        return None
    if all(_is_token_id(t) for t in value):
        return [int(t) for t in value]
    if value and _is_token_id(value[0]):  # meant as token ids
        i, bad = next((i, t) for i, t in enumerate(value) if not _is_token_id(t))
        raise TypeError(f"{where}[{i}]: a token id must be an int, got {type(bad).__name__}: {bad!r:.40}")
    return None


def _one_prompt(value: object, where: str) -> PromptInput | None:
    """value as one prompt, None when it is not a single prompt (it may be a list of them)."""
    if isinstance(value, str):
        return value
    ids = _token_ids(value, where)
    if ids is not None:
        return ids
    if not isinstance(value, dict):
        return None
    value = {key: v for key, v in value.items()
             if not ((key in UNSUPPORTED_PROMPT_KEYS or key == "cache_salt") and v is None)}
    unsupported = sorted(UNSUPPORTED_PROMPT_KEYS & value.keys())
    if unsupported:
        raise ValueError(f"{where}: {', '.join(unsupported)} is not supported by this engine (text prompts only)")
    salt = value.pop("cache_salt", None)
    try:
        check_cache_salt(salt)
    except InvalidRequestError as exc:
        raise ValueError(f"{where}['cache_salt']: {exc}") from None
    prompt = _prompt_of_dict(value, where)
    return prompt if salt is None else SaltedPrompt(prompt, salt)


def _prompt_of_dict(value: dict, where: str) -> str | list[int]:
    unknown = sorted(map(repr, value.keys() - {"prompt", "prompt_token_ids"}))
    if unknown:
        raise TypeError(f"{where}: unknown prompt key(s) {', '.join(unknown)}; a prompt is {PROMPT_FORMS}")
    if "prompt" not in value and "prompt_token_ids" not in value:
        raise TypeError(f"{where}: a prompt dict needs 'prompt' (str) or 'prompt_token_ids' (a list of token ids), "
                        f"got keys {sorted(value)}")
    if "prompt" in value and not isinstance(value["prompt"], str):
        raise TypeError(f"{where}['prompt'] must be a str, got {type(value['prompt']).__name__}")
    if "prompt_token_ids" not in value:
        return value["prompt"]
    # A TokensPrompt may carry its text too, for display (vLLM's "prompt"): the ids are the prompt.
    ids = _token_ids(value["prompt_token_ids"], f"{where}['prompt_token_ids']")
    if ids is None:
        raise TypeError(f"{where}['prompt_token_ids'] must be a list of int token ids, "
                        f"got {value['prompt_token_ids']!r:.80}")
    return ids


def parse_prompts(prompts: object, name: str = "prompts") -> list[PromptInput]:
    """The prompts of one generate call, in order."""
    if isinstance(prompts, (list, tuple)) and not prompts:
        return []
    single = _one_prompt(prompts, name)
    if single is not None:
        return [single]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"{name} must be {PROMPT_FORMS}; got {type(prompts).__name__}")
    parsed = []
    for i, item in enumerate(prompts):
        prompt = _one_prompt(item, f"{name}[{i}]")
        if prompt is None:
            raise TypeError(f"{name}[{i}] must be a str, a list of token ids, {{\"prompt\": str}} or "
                            f"{{\"prompt_token_ids\": [int, ...]}}; got {type(item).__name__}: {item!r:.80}")
        parsed.append(prompt)
    return parsed


class ContentPartError(ValueError):
    """A message content part this engine cannot take; ``index`` is the part's position."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index


def message_text(content: object, where: str) -> str:
    """A message's content as the chat template sees it: a str, or OpenAI's list of text parts
    (joined by newlines). Any other part is refused, naming it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TypeError(f"{where} must be a str or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ContentPartError(f'{where}[{j}]: only text parts ({{"type": "text", "text": ...}}) are '
                                   f"supported, got {kind!r}", j)
        texts.append(part["text"])
    return "\n".join(texts)


def _message(message: object, where: str) -> dict:
    if not isinstance(message, dict):
        raise TypeError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}")
    if not isinstance(message.get("role"), str) or message["role"] not in CHAT_ROLES:
        raise ValueError(f"{where}['role'] must be one of {sorted(CHAT_ROLES)}, got {message.get('role')!r}")
    out = dict(message)
    if message.get("content") is not None:  # an assistant's tool-call message may have none
        out["content"] = message_text(message["content"], f"{where}['content']")
    return out


def parse_conversations(messages: object, name: str = "messages") -> list[list[dict]]:
    """One conversation (a list of message dicts) or a list of them, as lists of messages whose
    content is text."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError(f"{name} must be a non-empty conversation (a list of message dicts) or a list of them, "
                        f"got {type(messages).__name__}")
    if isinstance(messages[0], dict):
        return [[_message(m, f"{name}[{i}]") for i, m in enumerate(messages)]]
    conversations = []
    for c, conversation in enumerate(messages):
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise TypeError(f"{name}[{c}] must be a non-empty list of message dicts, got {type(conversation).__name__}")
        conversations.append([_message(m, f"{name}[{c}][{i}]") for i, m in enumerate(conversation)])
    return conversations
