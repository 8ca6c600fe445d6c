"""Keys and types against the schemas: unknown keys (with a "did you mean"), one-line type errors.

Hydra's ``+key=value`` adds a key even to a structured config, and OmegaConf's merge of one
typed node onto another keeps it, so ``+trainer.max_step=5`` used to be dropped silently by
``to_object``. :func:`check_known_keys` walks the composed config against the dataclasses
instead; :func:`describe_omegaconf_error` turns OmegaConf's multi-line validation errors into
one line naming the key, the value, the expected type and an example.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Dict, List, Optional

from omegaconf import MISSING
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    OmegaConfBaseException,
    ValidationError,
)

from hetseq_hpc.errors import ConfigError


def _hints(schema: type) -> Dict[str, Any]:
    """Field name -> resolved type of a schema dataclass."""
    hints = typing.get_type_hints(schema)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(schema)}


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _suggest(key: str, schema: type, parent: str) -> str:
    names = list(_hints(schema))
    close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
    where = f"{parent}." if parent else ""
    if close:
        return f"did you mean {where}{close[0]}?"
    return f"the keys of {parent or 'the configuration'} are {', '.join(names)}"


def unknown_key_message(full_key: str, key: Any, schema: type) -> str:
    """One line for a key that ``schema`` does not have, with the closest known key (or, for a
    key that moved to another group, its new place: :mod:`hetseq_hpc.config.aliases`)."""
    from hetseq_hpc.config.aliases import new_key

    moved = new_key(full_key)
    if moved is not None:
        return (
            f"{full_key} is now {moved}: write {moved} (in a YAML file too; on the command "
            "line the old key is still rewritten)"
        )
    parent = full_key[: -len(str(key))].rstrip(".") if full_key.endswith(str(key)) else ""
    return (
        f"{full_key} is not a setting: {_suggest(key, schema, parent)} "
        "(fix the spelling or remove it; '+' cannot add settings)"
    )


def _walk(node: Any, schema: Any, where: str, choose: Dict[str, Optional[type]]) -> None:
    schema = _unwrap_optional(schema)
    if not isinstance(node, dict):
        return
    if dataclasses.is_dataclass(schema):
        hints = _hints(schema)
        for key, value in node.items():
            full = f"{where}.{key}" if where else str(key)
            if key not in hints:
                raise ConfigError(unknown_key_message(full, key, schema))
            child = choose[full] if full in choose else hints[key]
            if child is not None:
                _walk(value, child, full, choose)
    elif typing.get_origin(schema) in (dict, Dict):
        value_type = _unwrap_optional(typing.get_args(schema)[1])
        if dataclasses.is_dataclass(value_type):
            for key, value in node.items():
                _walk(value, value_type, f"{where}.{key}", choose)


def check_known_keys(
    container: Dict[str, Any],
    run_schema: type,
    task_schemas: Dict[str, type],
    cluster_schemas: Dict[str, type],
) -> None:
    """Every key of ``container`` (a plain dict of a whole run) is a field of its schema.

    ``task`` and ``cluster`` are checked against the schema their ``name`` selects (an unknown
    name is left to the caller, which reports it).

    Raises:
        ConfigError: ``<key> is not a setting: did you mean <closest>?`` (difflib).
    """

    def pick(group: str, table: Dict[str, type]) -> Optional[type]:
        node = container.get(group)
        name = node.get("name") if isinstance(node, dict) else None
        return table.get(name) if isinstance(name, str) else None

    choose = {"task": pick("task", task_schemas), "cluster": pick("cluster", cluster_schemas)}
    _walk(container, run_schema, "", choose)


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_EXAMPLES = {int: "1", float: "0.5", bool: "true", str: "text"}


def _describe(tp: Any) -> str:
    """``Optional[List[int]]`` -> ``"a list of integers (or null)"``."""
    inner = _unwrap_optional(tp)
    suffix = " (or null)" if inner is not tp else ""
    origin = typing.get_origin(inner)
    if origin in (list, List):
        item = _describe(typing.get_args(inner)[0]).split(" ", 1)[-1]
        return f"a list of {item}s{suffix}"
    if origin in (dict, Dict):
        return f"a mapping {{key: value}}{suffix}"
    return _TYPE_WORDS.get(inner, getattr(inner, "__name__", str(inner))) + suffix


def _example_value(tp: Any) -> str:
    """An override value of type ``tp``: ``1``, ``0.5``, ``[1,2]``, ``{}`` ..."""
    inner = _unwrap_optional(tp)
    origin = typing.get_origin(inner)
    if origin in (list, List):
        item = _example_value(typing.get_args(inner)[0])
        return f"[{item},{item}]"
    if origin in (dict, Dict):
        return "{}"
    return _EXAMPLES.get(inner, "1")


def _example(schema: type, key: str) -> str:
    """The field's default written as an override value, else an example of its type."""
    for f in dataclasses.fields(schema):
        if f.name != key:
            continue
        value = f.default
        if value is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, (int, float)) or (isinstance(value, str) and value != MISSING):
            return str(value)
        if isinstance(value, list) and value:
            return "[" + ",".join(str(v) for v in value) + "]"
    return _example_value(_hints(schema).get(key, Any))


def describe_omegaconf_error(exc: BaseException) -> str:
    """One line for an OmegaConf/Hydra error found anywhere in ``exc``'s cause chain.

    A type error becomes ``trainer.max_steps='abc' is not valid: expected an integer; write
    e.g. trainer.max_steps=1000``; an unknown key gets a "did you mean"; anything else is the
    first line of the message, prefixed with the key when OmegaConf knows it.
    """
    chain: List[BaseException] = []
    cur: Optional[BaseException] = exc
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    for err in chain:
        full_key = getattr(err, "full_key", None)
        schema = getattr(err, "object_type", None)
        key = getattr(err, "key", None)
        if not full_key:
            continue
        unknown = isinstance(err, (ConfigKeyError, ConfigAttributeError))
        if unknown and dataclasses.is_dataclass(schema) and key is not None:
            return unknown_key_message(full_key, key, schema)
        if isinstance(err, ValidationError):
            return _type_message(err, full_key, schema, key)
    for err in chain:
        missing, options = getattr(err, "missing_cfg_file", None), getattr(err, "options", None)
        if missing and options is not None and "/" in str(missing):
            group, name = str(missing).rsplit("/", 1)
            choices = ", ".join(o for o in options if not o.endswith("_schema"))
            return (
                f"{group}={name} is not an option: choose one of {choices} (files in conf/{group}/)"
            )
    text = " ".join(str(exc).split()) or type(exc).__name__
    for err in chain:
        if isinstance(err, OmegaConfBaseException) and getattr(err, "full_key", None):
            first = str(getattr(err, "msg", err)).strip().splitlines()[0]
            return f"{err.full_key}: {first}"
    return text


def _type_message(err: ValidationError, full_key: str, schema: Any, key: Any) -> str:
    value = getattr(err, "value", None)
    first = str(getattr(err, "msg", err)).strip().splitlines()[0]
    if dataclasses.is_dataclass(schema) and isinstance(key, str) and key in _hints(schema):
        expected = _describe(_hints(schema)[key])
        return (
            f"{full_key}={value!r} is not valid: expected {expected}; write e.g. "
            f"{full_key}={_example(schema, key)}"
        )
    ref = getattr(err, "ref_type", None)
    if isinstance(key, int) and typing.get_origin(_unwrap_optional(ref)) in (list, List):
        inner = typing.get_args(_unwrap_optional(ref))[0]
        return (
            f"{full_key}={value!r} is not valid: expected {_describe(inner)} in this list; "
            f"write e.g. {full_key.rsplit('[', 1)[0]}={_example_value(ref)}"
        )
    return f"{full_key}={value!r} is not valid ({first}): fix the value"
