"""What a request asks its output to follow (vLLM's ``SamplingParams.structured_outputs``): a
JSON schema, any JSON object, a regex, one of a list of strings, or a grammar (Lark or GBNF),
and its translation into an llguidance grammar.

No torch here: the API server checks requests with it before they reach the engine core,
where engine/grammar.py compiles them and keeps one matcher per sequence.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance

# JSON whitespace, at most this many characters between two tokens of the JSON text. Unbounded
# whitespace (the JSON standard's, vLLM's default) lets a small model emit newlines until
# max_tokens, a well-known failure of JSON mode; a bound keeps pretty-printed JSON possible.
DEFAULT_JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,32}"
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True)
class StructuredOutputsParams:
    """Exactly one of json, regex, choice, grammar, json_object. A bad value raises
    ``ValueError`` whose message starts with the field name; ``check()`` also compiles the
    grammar once without a tokenizer, so an invalid schema, regex or grammar fails here."""
    json: str | dict | None = None  # a JSON schema; always a canonical JSON string after __post_init__
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF
    json_object: bool | None = None  # any JSON object
    disable_any_whitespace: bool = False  # JSON: no whitespace between tokens at all
    whitespace_pattern: str | None = None  # JSON: a regex for whitespace between tokens

    def __post_init__(self) -> None:
        chosen = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(_KINDS)}; got "
                             f"{', '.join(chosen) or 'none'}")
        if self.json is not None:
            self.json = _canonical_schema(self.json)
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {type(value).__name__}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise ValueError("choice must be a non-empty list of strings")
            self.choice = list(self.choice)
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {type(value).__name__}")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def grammar_spec(self) -> str:
        """The llguidance grammar: the compile cache's key, the same for equal requests."""
        if self.json is not None or self.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema(
                self.json if self.json is not None else '{"type": "object"}', defaults=self._json_options())
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return llguidance.grammar_from("choice", self.choice)
        return llguidance.grammar_from("grammar", self.grammar)

    def _json_options(self) -> dict:
        if self.disable_any_whitespace:
            return {"whitespace_flexible": False}
        return {"whitespace_pattern": self.whitespace_pattern or DEFAULT_JSON_WHITESPACE}

    def check(self) -> None:
        """Raises ValueError naming the field when the schema, regex or grammar is invalid (or
        uses a JSON-schema keyword the backend cannot enforce)."""
        try:
            spec = self.grammar_spec()
        except ValueError as exc:
            raise ValueError(f"{self.kind}: {exc}") from None
        error = llguidance.LLMatcher.validate_grammar(spec)
        if error:
            raise ValueError(f"{self.kind}: {error.strip()}")


def _canonical_schema(schema: object) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"json: not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"json must be a JSON schema (an object), got {type(schema).__name__}")
    try:
        # Key order kept: properties are generated in the order the schema lists them.
        return json.dumps(_closed(schema), separators=(",", ":"), allow_nan=False)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"json: cannot be encoded as JSON: {exc}") from None


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames",
                  "unevaluatedProperties", "additionalItems")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")


def _closed(schema: object) -> object:
    """A copy where an object schema that lists properties and says nothing of others allows
    no others (what OpenAI's strict mode requires and xgrammar, vLLM's default backend, does):
    otherwise a small model tends to keep inventing keys until max_tokens."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_VALUES:
        if key in out:
            out[key] = _closed(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(sub) for sub in out[key]]
    if "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out
