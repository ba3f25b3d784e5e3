"""Structured output's grammars: a JSON Schema (JSON text) or a regular expression compiled to an
llguidance grammar. Torch-free: the gateway checks a request's constraint here before accepting
it; the workers mask tokens with it (`pdq.engine.constraint`). JSON comes out compact (no
whitespace between tokens): the model cannot wander off in spaces."""

import json

JSON_OPTIONS = {"whitespace_flexible": False}
MAX_GRAMMAR_CHARS = 65536


def grammar(json_schema: str = "", regex: str = "") -> str:
    """The llguidance grammar of a JSON Schema (JSON text) or a regex; "" for none."""
    import llguidance

    if json_schema:
        return llguidance.LLMatcher.grammar_from_json_schema(json.loads(json_schema), overrides=JSON_OPTIONS)
    if regex:
        return llguidance.LLMatcher.grammar_from_regex(regex)
    return ""


def check(json_schema: str = "", regex: str = "") -> str:
    """Why a constraint cannot be used ("" when it can): both given, too long, not JSON, or not
    compilable."""
    import llguidance

    if json_schema and regex:
        return "give a JSON schema or a regex, not both"
    if len(json_schema) + len(regex) > MAX_GRAMMAR_CHARS:
        return f"at most {MAX_GRAMMAR_CHARS} characters"
    if json_schema:
        try:
            schema = json.loads(json_schema)
        except ValueError as exc:
            return f"not valid JSON: {exc}"
        if not isinstance(schema, dict):
            return "a JSON Schema is a JSON object"
    try:
        g = grammar(json_schema, regex)
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return llguidance.LLMatcher.validate_grammar(g) if g else ""
