"""What a request asks its output to follow (vLLM's ``SamplingParams.structured_outputs``): a
JSON schema, any JSON object, a regex, one of a list of strings, or a grammar (Lark or GBNF),
and its translation into an llguidance grammar.

No torch here: the API server checks requests with it before they reach the engine core,
where engine/grammar.py compiles them and keeps one matcher per sequence.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

# A schema, regex, grammar or choice list longer than this is refused at the edge: compiles and
# caches stay bounded (a 32 MiB body could otherwise hold one).
MAX_SPEC_CHARS = 256 * 1024
# JSON whitespace, at most this many characters between two tokens of the JSON text. Unbounded
# whitespace (the JSON standard's, vLLM's default) lets a small model emit newlines until
# max_tokens, a well-known failure of JSON mode; a bound keeps pretty-printed JSON possible.
DEFAULT_JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,32}"
_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# A GBNF rule definition at the start of a line ("root ::= ..."); [ \t] never spans lines, so
# the search stays linear (llguidance's own dialect detection is quadratic).
_GBNF_RULE = re.compile(r"^[ \t]*[\w-]+[ \t]*::=", re.MULTILINE)


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
        if self.disable_any_whitespace is None:  # JSON null, as some clients send unset options
            self.disable_any_whitespace = False
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {type(value).__name__}")
        size = sum(len(v) for v in (self.json, self.regex, self.grammar, self.whitespace_pattern) if v) + sum(
            len(c) + 1 for c in self.choice or ())
        if size > MAX_SPEC_CHARS:
            raise ValueError(f"{self.kind} is {size} characters long; at most {MAX_SPEC_CHARS} are accepted")

    @property
    def cache_key(self) -> tuple:
        """Equal for requests that compile to the same grammar (cheap: no translation)."""
        return (self.json, self.regex, tuple(self.choice) if self.choice else None, self.grammar, self.json_object,
                self.disable_any_whitespace, self.whitespace_pattern)

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
        # GBNF (llama.cpp's) has "::=" where Lark has ":" (llguidance's own detection of the
        # dialect takes quadratic time on long inputs).
        grammar = gbnf_to_lark(self.grammar) if _GBNF_RULE.search(self.grammar) else self.grammar
        return llguidance.LLMatcher.grammar_from_lark(grammar)

    def _json_options(self) -> dict:
        if self.disable_any_whitespace:
            return {"whitespace_flexible": False}
        return {"whitespace_pattern": self.whitespace_pattern or DEFAULT_JSON_WHITESPACE}

    def check(self, tokenizer: llguidance.LLTokenizer | None = None) -> None:
        """Raises ValueError naming the field when the schema, regex or grammar is invalid (or
        uses a JSON-schema keyword the backend cannot enforce; with the model's ``tokenizer``,
        also a token the vocabulary lacks)."""
        try:
            spec = self.grammar_spec()
        except Exception as exc:  # the GBNF converter raises its own errors
            raise ValueError(f"{self.kind}: {exc}") from None
        error = llguidance.LLMatcher.validate_grammar(spec, tokenizer)
        if error:
            raise ValueError(f"{self.kind}: {error.strip()}")


def _canonical_schema(schema: object) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"json: not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"json must be a JSON schema (an object), got {type(schema).__name__}")
    try:
        # Key order kept: properties are generated in the order the schema lists them.
        return json.dumps(_closed(schema), separators=(",", ":"), allow_nan=False)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"json: cannot be encoded as JSON: {exc}") from None


# Where plain subschemas sit. Combinators (allOf, anyOf, oneOf, not, if/then/else) and $ref
# are left alone: their parts add properties to each other, so closing one would reject what
# another allows.
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_VALUES = ("items", "additionalProperties")
_COMBINED = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "dependentSchemas",
             "unevaluatedProperties", "additionalProperties")


def _closed(schema: object) -> object:
    """A copy where a plain object schema that lists properties and says nothing of others
    allows no others (what OpenAI's strict mode requires and xgrammar, vLLM's default backend,
    does): otherwise a small model tends to keep inventing keys until max_tokens."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_VALUES:
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
    if isinstance(out.get("prefixItems"), list):
        out["prefixItems"] = [_closed(sub) for sub in out["prefixItems"]]
    if "properties" in out and not any(key in out for key in _COMBINED):
        out["additionalProperties"] = False
    return out
