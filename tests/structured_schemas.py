"""JSON schemas of different shapes for the structured-output tests and benchmark. Strings and
arrays are bounded so a greedy model always finishes inside the tests' max_tokens."""

NAME = {"type": "string", "minLength": 1, "maxLength": 12}

SCHEMAS: dict[str, dict] = {
    "flat_object": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer"}},
                    "required": ["name", "age"]},
    "nested_object": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": NAME, "email": {"type": "string", "maxLength": 24}},
                 "required": ["name", "email"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    "int_array": {"type": "object", "properties": {
        "numbers": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}},
        "required": ["numbers"]},
    "string_enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                    "required": ["color"]},
    "bounded_number": {"type": "object", "properties": {
        "temperature": {"type": "number", "minimum": -50, "maximum": 60}}, "required": ["temperature"]},
    "bounded_integer": {"type": "object", "properties": {
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "offset": {"type": "integer", "minimum": -10, "maximum": -1}}, "required": ["year", "offset"]},
    "optional_fields": {"type": "object", "properties": {
        "title": NAME, "subtitle": NAME, "pages": {"type": "integer", "minimum": 1, "maximum": 999}},
        "required": ["title"], "additionalProperties": False},
    "boolean_flags": {"type": "object", "properties": {"ok": {"type": "boolean"}, "done": {"type": "boolean"}},
                      "required": ["ok", "done"], "additionalProperties": False},
    "array_of_objects": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"]},
    "nullable": {"type": "object", "properties": {"nickname": {"type": ["string", "null"], "maxLength": 12}},
                 "required": ["nickname"]},
    "any_of": {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer"}, NAME]}},
               "required": ["id"]},
    "const": {"type": "object", "properties": {"version": {"const": 2}, "kind": {"const": "report"}},
              "required": ["version", "kind"]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                "required": ["code"]},
    "nested_arrays": {"type": "object", "properties": {"grid": {"type": "array", "minItems": 2, "maxItems": 2,
                                                                  "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                                                            "items": {"type": "integer"}}}},
                      "required": ["grid"]},
    "mixed_enum": {"type": "object", "properties": {"value": {"enum": [1, "two", True, None]}},
                   "required": ["value"]},
    "date_format": {"type": "object", "properties": {"when": {"type": "string", "format": "date"}},
                    "required": ["when"]},
    "refs": {"type": "object", "$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"], "additionalProperties": False}},
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"]},
    "string_lengths": {"type": "object", "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 5}},
                       "required": ["word"]},
    "top_level_array": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    "top_level_string": {"type": "string", "maxLength": 16},
    "deep_nesting": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["c"]}},
        "required": ["b"]}}, "required": ["a"]},
    "string_array_unique_size": {"type": "object", "properties": {"tags": {
        "type": "array", "items": NAME, "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    "exclusive_bounds": {"type": "object", "properties": {
        "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}, "required": ["ratio"]},
    "person_record": {"type": "object", "properties": {
        "first": NAME, "last": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "de", "es"]}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]}},
        "required": ["first", "last", "age", "address"], "additionalProperties": False},
}
