"""Structured outputs in the API: the fields that ask for a constraint, and the sampling fields that
become per-row logit adjustments.

Constraint fields (at most one may be set; each refusal is a 400 naming the field):
- OpenAI's `response_format`: `{"type": "text"}` (none), `{"type": "json_object"}` (any JSON
  object), `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`.
- vLLM's `structured_outputs` (`{"json": ..., "regex": ..., "choice": [...], "grammar": ...}`,
  one key) and its older top-level `guided_json`, `guided_regex`, `guided_choice`,
  `guided_grammar`.

The constraint is compiled (`Engine.compile_constraint`, cached per constraint) on the request's
preparation thread, never on the event loop or the engine thread, within the engine's compile time
bound; a schema too large, malformed or using what xgrammar does not support is a 400 naming the
field.
"""

from __future__ import annotations

from typing import Any

from batchkv.errors import DependencyError, RequestError
from batchkv.executor.constraints import Constraint
from batchkv.serve.protocol import APIError

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _build(kind: str, value: Any, field: str) -> Constraint:
    if kind == "json_schema":
        if isinstance(value, (str, dict)):
            return Constraint.json_schema(value, field=field)
        raise RequestError(f"{field}: a JSON schema is an object (or its JSON text), not {type(value).__name__}")
    if kind == "regex":
        return Constraint.regex(value, field=field)
    if kind == "choice":
        return Constraint.choice(value, field=field)
    return Constraint.grammar(value, field=field)


def _response_format(value: dict[str, Any]) -> Constraint | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_schema(None, field="response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or ("schema" not in spec and "name" not in spec):
            raise RequestError("response_format: json_schema needs {'name': ..., 'schema': {...}}")
        schema = spec.get("schema", {"type": "object"})
        return Constraint.json_schema(schema, field="response_format")
    raise RequestError(f"response_format: type {kind!r} is not one of text, json_object, json_schema")


def constraint_of(body: Any) -> Constraint | None:
    """The constraint a request body asks for, or None; APIError(400) naming the field when it is
    malformed or when more than one field asks."""
    asked: list[tuple[str, Any]] = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None:
        asked.append(("response_format", fmt))
    for name in GUIDED:
        if getattr(body, name, None) is not None:
            asked.append((name, getattr(body, name)))
    if getattr(body, "structured_outputs", None) is not None:
        asked.append(("structured_outputs", body.structured_outputs))
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise APIError(400, f"{names} each ask for a constraint; set at most one", param=asked[1][0])
    if not asked:
        return None
    name, value = asked[0]
    try:
        if name == "response_format":
            if not isinstance(value, dict):
                raise RequestError("response_format is an object such as {'type': 'json_object'}")
            return _response_format(value)
        if name == "structured_outputs":
            keys = [k for k in value if value[k] is not None] if isinstance(value, dict) else []
            if len(keys) != 1 or keys[0] not in STRUCTURED_KEYS:
                raise RequestError(f"structured_outputs takes exactly one of {', '.join(STRUCTURED_KEYS)}")
            return _build(STRUCTURED_KEYS[keys[0]], value[keys[0]], name)
        kind = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice"}
        return _build(kind.get(name, "grammar"), value, name)
    except RequestError as exc:
        raise APIError(400, str(exc), param=name) from None


def compile_constraint(engine: Any, constraint: Constraint) -> None:
    """Compile `constraint` for `engine` (cached there); APIError(400) naming its field when it
    cannot be, or when the server cannot constrain at all (no tokenizer or no xgrammar)."""
    if getattr(engine, "grammars", None) is None:
        raise APIError(
            400,
            f"{constraint.field} needs constrained decoding, which this server cannot do (its model has no "
            "tokenizer, or xgrammar is not installed: pip install 'batchkv[structured]')",
            param=constraint.field,
        )
    try:
        engine.compile_constraint(constraint)
    except (RequestError, DependencyError) as exc:
        raise APIError(400, str(exc), param=constraint.field) from None


def logit_bias(value: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON object keys) as {int id: bias}; APIError(400) naming
    logit_bias for a key that is not an id."""
    out: dict[int, float] = {}
    for key, bias in (value or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
        out[token] = bias
    return out
