"""Strict readers for provider JSON: every wrong shape becomes a :class:`PayloadError` naming the field.

Provider payloads are untrusted input even after their signature verified (a provider can change a
format), so nothing here lets a ``KeyError`` or ``TypeError`` escape: each accessor takes the dotted
path of what it reads, and says which field was missing or of the wrong type.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, NoReturn

from sendonce.webhooks.events import PayloadError

_DETAIL_TEXT_LIMIT = 500


def _reject_constant(name: str) -> NoReturn:
    # NaN and Infinity are not JSON; PostgreSQL's jsonb would refuse them later, far from the cause.
    raise ValueError(f"{name} is not valid JSON")


def parse_json(data: bytes | str, what: str) -> Any:
    """Decode JSON, refusing invalid UTF-8, NaN/Infinity and absurd nesting with a :class:`PayloadError`."""
    try:
        return json.loads(data, parse_constant=_reject_constant)
    except RecursionError:
        raise PayloadError(f"{what} is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise PayloadError(f"{what} is not valid JSON: {exc}") from None


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }.get(type(value), type(value).__name__)


def as_object(value: object, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise PayloadError(f"{path} must be an object, not {_type_name(value)}")
    return value


def as_list(value: object, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise PayloadError(f"{path} must be an array, not {_type_name(value)}")
    return value


def as_str(value: object, path: str) -> str:
    if not isinstance(value, str):
        raise PayloadError(f"{path} must be a string, not {_type_name(value)}")
    return value


def required(obj: Mapping[str, Any], key: str, path: str) -> Any:
    if key not in obj or obj[key] is None:
        raise PayloadError(f"{path}.{key} is missing" if path else f"{key} is missing")
    return obj[key]


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def req_str(obj: Mapping[str, Any], key: str, path: str = "") -> str:
    value = as_str(required(obj, key, path), _join(path, key))
    if not value:
        raise PayloadError(f"{_join(path, key)} is empty")
    return value


def opt_str(obj: Mapping[str, Any], key: str, path: str = "") -> str | None:
    """A string field that may be absent or null; an empty string counts as absent."""
    value = obj.get(key)
    if value is None:
        return None
    return as_str(value, _join(path, key)) or None


def opt_id(obj: Mapping[str, Any], key: str, path: str = "") -> str | None:
    """An identifier that providers send as a string or a number (never a boolean)."""
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise PayloadError(f"{_join(path, key)} must be a string or a number, not {_type_name(value)}")
    return str(value) or None


def req_id(obj: Mapping[str, Any], key: str, path: str = "") -> str:
    value = opt_id(obj, key, path)
    if value is None:
        raise PayloadError(f"{_join(path, key)} is missing")
    return value


def req_object(obj: Mapping[str, Any], key: str, path: str = "") -> dict[str, Any]:
    return as_object(required(obj, key, path), _join(path, key))


def opt_object(obj: Mapping[str, Any], key: str, path: str = "") -> dict[str, Any] | None:
    value = obj.get(key)
    return None if value is None else as_object(value, _join(path, key))


def req_list(obj: Mapping[str, Any], key: str, path: str = "") -> list[Any]:
    return as_list(required(obj, key, path), _join(path, key))


def opt_list(obj: Mapping[str, Any], key: str, path: str = "") -> list[Any]:
    value = obj.get(key)
    return [] if value is None else as_list(value, _join(path, key))


def parse_iso_time(value: str, path: str, *, require_offset: bool = False) -> datetime:
    """ISO-8601 to aware UTC. Providers that omit the offset mean UTC; our own format must state it."""
    try:
        # Python 3.11 reads "Z" and any number of fractional digits (Postmark sends seven).
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise PayloadError(f"{path} is not an ISO-8601 timestamp: {value[:64]!r}") from None
    if parsed.tzinfo is None:
        if require_offset:
            raise PayloadError(f"{path} must include a UTC offset (e.g. 'Z'): {value[:64]!r}")
        parsed = parsed.replace(tzinfo=UTC)
    try:
        return parsed.astimezone(UTC)
    except OverflowError:  # year 9999 with a negative offset, and the like
        raise PayloadError(f"{path} is out of range: {value[:64]!r}") from None


def opt_iso_time(obj: Mapping[str, Any], key: str, path: str = "") -> datetime | None:
    value = opt_str(obj, key, path)
    return None if value is None else parse_iso_time(value, _join(path, key))


def opt_unix_time(obj: Mapping[str, Any], key: str, path: str = "") -> datetime | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PayloadError(f"{_join(path, key)} must be a unix timestamp, not {_type_name(value)}")
    try:
        return datetime.fromtimestamp(value, UTC)
    except (OverflowError, OSError, ValueError):
        raise PayloadError(f"{_join(path, key)} is out of range: {value!r}") from None


def short(value: object) -> object:
    """A diagnostic value for ``detail``: scalars kept, long text cut, anything else dropped to None."""
    if isinstance(value, str):
        return value if len(value) <= _DETAIL_TEXT_LIMIT else value[: _DETAIL_TEXT_LIMIT - 1] + "…"
    if isinstance(value, bool | int) or value is None:
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return [short(item) for item in value[:5]]
    return None


def detail(**values: object) -> dict[str, Any]:
    """``detail`` from keyword arguments, leaving out what is absent."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        kept = short(value)
        if kept is not None and kept != "" and kept != []:
            out[key] = kept
    return out


def lookup_ci(pairs: Mapping[str, Any], name: str) -> Any:
    """``pairs[name]`` with the key compared case-insensitively (header names, metadata keys)."""
    wanted = name.lower()
    for key, value in pairs.items():
        if isinstance(key, str) and key.lower() == wanted:
            return value
    return None


def job_id_value(value: object, path: str) -> str | None:
    """A job id as echoed back: a string, a number, or a one-element list (SES tags are lists)."""
    if isinstance(value, list):
        value = value[0] if value else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise PayloadError(f"{path} must be a string, not {_type_name(value)}")
    return str(value).strip() or None


def header_from_list(items: object, name: str, path: str, *, key: str = "name", value_key: str = "value") -> Any:
    """The value of header ``name`` in a list of ``{name, value}`` objects, compared case-insensitively."""
    wanted = name.lower()
    for index, item in enumerate(as_list(items, path)):
        entry = as_object(item, f"{path}[{index}]")
        item_name = entry.get(key)
        if isinstance(item_name, str) and item_name.strip().lower() == wanted:
            return entry.get(value_key)
    return None
