"""Typed payloads, sans I/O: what services send besides msgpack's own types, lowered to the
plain values every receiver decodes, and raised back to a handler's annotated type.

``lower`` is the msgpack packer's hook (payload.py): it is called only for a value msgpack
cannot pack itself, so a plain payload costs nothing more. It turns a ``datetime``, ``date``,
``time``, ``timedelta`` (RFC 3339 / ISO 8601 text), ``Decimal`` and ``UUID`` (text), an
``Enum`` (its value), a dataclass, a msgspec ``Struct`` or a pydantic model (a map of its
fields, lowered likewise) into plain values: the wire stays plain msgpack, so an untyped
handler, an older receiver and the CLI read a map of str and numbers. ``bytes`` stay bytes.
Anything else is refused as before (a ``set`` too: only a typed field may hold one).

``converter`` makes, once per handler, the call that turns a decoded payload into the
handler's type (msgspec for Structs and dataclasses, pydantic's own ``model_validate``).
msgspec is the ``typed`` extra (``pip install 'servicebus[typed]'``): without it these
values are refused with that hint, and plain payloads work as ever.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["lower", "lowerable", "model_kind", "converter", "schemas"]

_SCALARS = (datetime.datetime, datetime.date, datetime.time, datetime.timedelta, decimal.Decimal,
            uuid.UUID, enum.Enum)
_KEEP = (bytes, bytearray, memoryview)  # msgpack's bin: left as they are
HINT = "pip install 'servicebus[typed]'"


_loaded: list[ModuleType] = []  # msgspec, once imported (an import statement per call costs)


def _msgspec(what: str) -> ModuleType:
    if _loaded:
        return _loaded[0]
    try:
        import msgspec
        import msgspec.inspect  # noqa: F401 - converter() resolves a type's fields with it
    except ImportError:  # pragma: no cover - the typed extra is not installed
        raise TypeError(f"{what} needs msgspec: {HINT}") from None
    _loaded.append(msgspec)
    return msgspec


def _is_model(value: Any) -> bool:
    """A pydantic model (v2), known by its methods: pydantic is never imported here."""
    return hasattr(type(value), "model_dump") and hasattr(type(value), "model_validate")


def _dump_model(value: Any) -> Any:
    if _is_model(value):
        # python mode: bytes stay bytes; the rest is lowered by msgspec. By alias and without
        # computed fields: what the model's own model_validate takes back.
        computed = set(getattr(type(value), "model_computed_fields", None) or ())
        return value.model_dump(by_alias=True, exclude=computed or None)
    raise TypeError(f"can not serialize {type(value).__name__!r} object")


def lowerable(value: Any) -> bool:
    """Whether ``lower`` takes ``value`` (not whether all of what it holds is sendable)."""
    cls = type(value)
    if hasattr(cls, "__struct_fields__") or isinstance(value, _SCALARS):
        return True
    return hasattr(cls, "__dataclass_fields__") and not isinstance(value, type) or _is_model(value)


def lower(value: Any) -> Any:
    """``value`` as plain msgpack values, or ``TypeError``: the packer's ``default``."""
    if not lowerable(value):
        _dump_model(value)  # raises
    return _msgspec(f"sending {_a(type(value).__name__)}").to_builtins(value, builtin_types=_KEEP, enc_hook=_dump_model)


def _a(name: str) -> str:
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def model_kind(tp: Any) -> str | None:
    """What kind of model the class ``tp`` is (``struct``, ``dataclass``, ``pydantic``), or
    None: a handler annotated with anything else gets the payload as it was decoded."""
    if not isinstance(tp, type):
        return None
    if hasattr(tp, "__struct_fields__"):
        return "struct"
    if hasattr(tp, "model_validate") and hasattr(tp, "model_json_schema"):
        return "pydantic"
    if dataclasses.is_dataclass(tp):
        return "dataclass"
    return None


def converter(tp: type) -> Callable[[Any], Any]:
    """The call that makes a ``tp`` of a decoded payload, raising the library's validation
    error (a ``ValueError``: msgspec's ``ValidationError``, pydantic's). ``TypeError`` now if
    ``tp`` cannot be built at all (a field typed with a name nothing resolves): found at
    registration, not as every message dead-lettered ``invalid``."""
    if model_kind(tp) == "pydantic":
        try:
            if not getattr(tp, "__pydantic_complete__", True):
                getattr(tp, "model_rebuild")(raise_errors=True)
        except Exception as exc:  # noqa: BLE001 - pydantic's PydanticUndefinedAnnotation and the like
            raise TypeError(f"{tp.__name__} cannot be a payload type: {exc}") from exc
        validate: Callable[[Any], Any] = getattr(tp, "model_validate")
        return validate
    msgspec = _msgspec(f"a handler of {tp.__name__}")
    try:
        msgspec.inspect.type_info(tp)  # resolves every field's type, as convert would later
    except Exception as exc:  # noqa: BLE001 - NameError, or msgspec's own for an odd type
        raise TypeError(f"{tp.__name__} cannot be a payload type: {type(exc).__name__}: {exc} "
                        "(are its fields' types importable where it is defined?)") from exc
    convert = msgspec.convert

    def to_type(payload: Any) -> Any:
        return convert(payload, type=tp, strict=False)
    return to_type


def schemas(types: list[type], ref: str = "#/components/schemas/{name}") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """JSON schemas of ``types`` (one each, usually a ``$ref``) and the named schemas they
    refer to, with ``$ref``s of the form ``ref``."""
    components: dict[str, Any] = {}
    out: list[dict[str, Any]] = [{} for _ in types]
    plain = [(i, tp) for i, tp in enumerate(types) if model_kind(tp) != "pydantic"]
    if plain:
        found, defs = _msgspec("a payload schema").json.schema_components(
            [tp for _, tp in plain], ref_template=ref)
        components.update(defs)
        for (i, _), schema in zip(plain, found):
            out[i] = schema
    for i, tp in enumerate(types):
        if model_kind(tp) == "pydantic":
            schema = getattr(tp, "model_json_schema")(ref_template=ref.replace("{name}", "{model}"))
            components.update(schema.pop("$defs", {}))
            components[tp.__name__] = schema
            out[i] = {"$ref": ref.format(name=tp.__name__)}
    return out, components
