"""Load a recipe: YAML with `extends:` inheritance and `--set` overrides, validated into a `Recipe`.

Every problem is reported as `FILE:LINE: dotted.path: message`, all of them in one `RecipeError`, so a
user fixes a recipe in one pass without reading a traceback. Imports stay light (no torch, no mlflow)
because `omni recipe check` must answer fast.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from omni_core.recipe.base import redact_userinfo
from omni_core.recipe.schema import Recipe

EXTENDS_KEY = "extends"
OVERRIDE_LABEL = "--set "  # how a value from an override is located: `--set key=value`

# Dotted path -> where its value was written: "FILE:LINE", or "--set key=value" for an override.
Locations = dict[str, str]


class RecipeError(Exception):
    """Every problem of one recipe at once; str() has one `FILE:LINE: dotted.path: message` per line."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Resolve `extends:`, apply `key=value` overrides, validate; raise one RecipeError listing all problems."""
    return load_located(path, overrides)[0]


def load_located(path: str | Path, overrides: Sequence[str] = ()) -> tuple[Recipe, Locations]:
    """`load_recipe`, and where each value was written: what later checks (runtime.preflight) name lines with."""
    data, locations = _load_with_extends(Path(os.path.normpath(path)), chain=())
    return _validated(data, locations, overrides), locations


def located_problem(locations: Locations, field: str, message: str) -> str:
    """`FILE:LINE: field: message` for a problem found after loading. Where: the last `--set` inside `field`
    (what the user just changed), else the line that wrote `field`, else the first line that wrote a key inside
    it (a section), else its deepest written ancestor's."""
    inside = [where for dotted, where in locations.items() if _is_within(dotted, field)]
    overrides = [where for where in inside if where.startswith(OVERRIDE_LABEL)]
    where = (overrides[-1] if overrides else None) or locations.get(field) or next(iter(inside), None)
    return _problem(where or _locate(tuple(field.split(".")), locations), field, message)


def override_recipe(recipe: Recipe, overrides: Sequence[str]) -> Recipe:
    """`recipe` with `key=value` overrides applied and validated again, as `load_recipe` applies them to a file."""
    return _validated(recipe.model_dump(mode="json"), {}, overrides) if overrides else recipe


def _validated(data: dict[str, Any], locations: Locations, overrides: Sequence[str]) -> Recipe:
    problems = [problem for problem in (_apply_override(data, locations, o) for o in overrides) if problem]
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as error:
        problems += _validation_problems(error, locations)
    if problems:
        raise RecipeError(problems)
    return recipe


def dump_recipe(recipe: Recipe) -> str:
    """The resolved recipe as standalone YAML (defaults included), loadable again by `load_recipe`."""
    return yaml.dump(
        recipe.model_dump(mode="json"), Dumper=_ReadableDumper, sort_keys=False, allow_unicode=True, width=100
    )


def flatten_recipe(recipe: Recipe) -> dict[str, str]:
    """Dotted keys to string values, the shape MLflow params need; lists and dicts of scalars stay one JSON value."""
    flat: dict[str, str] = {}
    _flatten_into(flat, "", recipe)
    return flat


# --- reading YAML with key lines -------------------------------------------------------------------------


class _RecipeYamlLoader(yaml.SafeLoader):
    """SafeLoader that reads `1e-3` and `1.0e5` as floats, as YAML 1.2 does: YAML 1.1 wants a dot and a signed
    exponent and would hand the schema a string, which strict number fields refuse."""


_RecipeYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


class _LineRecordingLoader(_RecipeYamlLoader):
    """SafeLoader that also records the 1-based line of every key (and list item) by dotted path.

    Duplicate keys in one mapping are recorded too: PyYAML would silently keep the last one, which hides
    exactly the kind of typo recipes are strict about.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.lines: dict[str, int] = {}
        self.duplicates: list[tuple[str, int, int]] = []  # (dotted path, first line, repeated line)
        self._duplicates_by_node: dict[int, list[tuple[str, int, int]]] = {}
        self._recorded_nodes: set[int] = set()

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        data = self.construct_document(node)
        self._record(node, "")
        return data

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        # Runs before merge keys (<<) are folded into node.value, so only the mapping's own keys are compared.
        if id(node) not in self._duplicates_by_node:
            first_lines: dict[str, int] = {}
            found = []
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key, line = str(self.construct_object(key_node)), key_node.start_mark.line + 1
                if key in first_lines:
                    found.append((key, first_lines[key], line))
                first_lines.setdefault(key, line)
            self._duplicates_by_node[id(node)] = found
        super().flatten_mapping(node)

    def _record(self, node: yaml.Node, path: str) -> None:
        # Each node is walked once: an alias reuses its anchor's lines through the prefix fallback, and
        # neither recursive aliases nor alias bombs can make this walk explode.
        self.lines.setdefault(path, node.start_mark.line + 1)
        if id(node) in self._recorded_nodes:
            return
        self._recorded_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, first, repeated in self._duplicates_by_node.get(id(node), ()):
                self.duplicates.append((_join(path, key), first, repeated))
            # After flattening, merged pairs come first and the mapping's own keys win, as in the data.
            winners = {str(self.construct_object(k)): (k, v) for k, v in node.value}
            for key, (key_node, value_node) in winners.items():
                key_path = _join(path, key)
                self.lines[key_path] = key_node.start_mark.line + 1
                self._record(value_node, key_path)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                self._record(item, _join(path, index))


def _read_mapping(path: Path) -> tuple[dict[str, Any], Locations]:
    """One file's top-level mapping and where each of its keys sits."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError([f"{path}: file not found"]) from None
    except (OSError, UnicodeDecodeError) as error:
        raise RecipeError([f"{path}: cannot read: {getattr(error, 'strerror', None) or error}"]) from None
    try:
        loader = _LineRecordingLoader(text)  # the reader refuses control characters (a NUL byte) right here
    except yaml.reader.ReaderError as error:
        line = text.count("\n", 0, error.position) + 1
        raise RecipeError(
            [f"{path}:{line}: invalid YAML: unacceptable character #x{error.character:04x} ({error.reason})"]
        ) from None
    try:
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        detail = error.problem
        if error.context:
            started = error.context_mark
            opened = f" started at line {started.line + 1}" if started and started.line != mark.line else ""
            detail = f"{error.context}{opened}: {detail}"
        raise RecipeError([f"{where}: invalid YAML: {detail}"]) from None
    except yaml.YAMLError as error:
        raise RecipeError([f"{path}: invalid YAML: {error}"]) from None
    finally:
        loader.dispose()
    locations = {dotted: f"{path}:{line}" for dotted, line in loader.lines.items()}
    if data is None:  # empty file: problems of the whole recipe still name it
        return {}, {"": str(path)}
    if not isinstance(data, dict):
        kind = _kind(data)
        raise RecipeError([_problem(locations[""], "", f"top level must be a mapping of sections, got {kind}")])
    if loader.duplicates:
        raise RecipeError(
            [f"{path}:{line}: {key}: duplicate key (first at line {first})" for key, first, line in loader.duplicates]
        )
    return data, locations


def _load_with_extends(path: Path, chain: tuple[Path, ...]) -> tuple[dict[str, Any], Locations]:
    """Merge the `extends:` chain from the root ancestor down to `path`; `chain` holds the files below it."""
    data, locations = _read_mapping(path)
    if EXTENDS_KEY not in data:
        return data, locations
    target = data.pop(EXTENDS_KEY)
    where = locations.get(EXTENDS_KEY)
    locations = {dotted: loc for dotted, loc in locations.items() if not _is_within(dotted, EXTENDS_KEY)}
    if not isinstance(target, str) or not target.strip():
        raise RecipeError([_problem(where, EXTENDS_KEY, "must be a recipe file path, relative to this file")])
    parent = Path(os.path.normpath(path.parent / target))
    visited = (*chain, path)
    if parent.resolve() in {p.resolve() for p in visited}:
        cycle = " -> ".join(str(p) for p in (*visited, parent))
        raise RecipeError([_problem(where, EXTENDS_KEY, f"extends cycle: {cycle}")])
    if not parent.is_file():
        raise RecipeError([_problem(where, EXTENDS_KEY, f"file not found: {parent}")])
    parent_data, parent_locations = _load_with_extends(parent, visited)
    replaced: list[str] = []
    merged = _deep_merge(parent_data, data, "", replaced)
    kept = {
        dotted: loc
        for dotted, loc in parent_locations.items()
        if not any(_is_within(dotted, prefix) for prefix in replaced)
    }
    return merged, kept | locations


def _deep_merge(base: dict, child: dict, path: str, replaced: list[str]) -> dict:
    """The one merge rule, of `extends:` and `--set` alike: a section of the schema (a mapping of named fields,
    `_is_section`) merges key by key; anything else in `child` replaces, a mapping of free keys (a mix, GPU
    overrides) included, so a child can drop a modality. Replaced paths go to `replaced`."""
    merged = dict(base)
    for key, value in child.items():
        key_path = _join(path, key)
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and _is_section(key_path):
            merged[key] = _deep_merge(merged[key], value, key_path, replaced)
        else:
            if key in merged:
                replaced.append(key_path)
            merged[key] = value
    return merged


# --- overrides ------------------------------------------------------------------------------------------


class _BadOverride(Exception):
    """An override path that cannot be walked; reported as a problem of that `--set`, never raised out."""


def _apply_override(data: dict[str, Any], locations: Locations, override: str) -> str | None:
    """Deep-set one `key=value` into `data`; return the problem, if any, instead of raising."""
    label = f"{OVERRIDE_LABEL}{redact_userinfo(override)}"
    key, has_equals, raw_value = override.partition("=")
    key = key.strip()
    if not has_equals or not key:
        return _problem(label, "", "expected key=value, e.g. train.lr=1e-3")
    parts = key.split(".")
    if not all(parts):
        return _problem(label, key, "empty segment in dotted key")
    try:
        value = yaml.load(raw_value, Loader=_RecipeYamlLoader)  # a SafeLoader
    except yaml.YAMLError as error:
        return _problem(label, key, f"value is not valid YAML: {getattr(error, 'problem', None) or error}")
    try:
        container: Any = data
        walked = ""
        for part in parts[:-1]:
            container, walked = _step_into(container, part, walked, locations, label)
        _assign(container, parts[-1], walked, value)
    except _BadOverride as error:
        return _problem(label, key, str(error))
    for dotted in [d for d in locations if _is_within(d, key)]:
        del locations[dotted]
    locations[key] = label
    return None


def _step_into(container: Any, part: str, walked: str, locations: Locations, label: str) -> tuple[Any, str]:
    """The child container at `part`, shallow-copied so YAML aliases and extends parents stay untouched."""
    path = _join(walked, part)
    if isinstance(container, dict):
        child = container.get(part)
        if child is None:
            child = [] if _is_list(path) else {}  # a list the file leaves out has no items to index
            locations[path] = label
        elif not isinstance(child, (dict, list)):
            raise _BadOverride(f"{path} is {_kind(child)} {child!r}, it has no keys to set")
        child = type(child)(child)
        container[part] = child
        return child, path
    index = _list_index(container, part, walked)
    child = container[index]
    if not isinstance(child, (dict, list)):
        raise _BadOverride(f"{path} is {_kind(child)} {child!r}, it has no keys to set")
    child = type(child)(child)
    container[index] = child
    return child, path


def _assign(container: Any, part: str, walked: str, value: Any) -> None:
    if isinstance(container, dict):
        path, old = _join(walked, part), container.get(part)
        if isinstance(value, dict) and isinstance(old, dict) and _is_section(path):
            container[part] = _deep_merge(old, value, path, [])
        else:
            container[part] = value
    else:
        container[_list_index(container, part, walked)] = value


def _list_index(items: list, part: str, walked: str) -> int:
    if not part.isdigit():
        raise _BadOverride(f"{walked} is a list, {part!r} is not an index")
    if int(part) >= len(items):
        raise _BadOverride(f"{walked} has {len(items)} item(s), no index {part}")
    return int(part)


# --- validation errors ----------------------------------------------------------------------------------


def _validation_problems(error: ValidationError, locations: Locations) -> list[str]:
    problems = []
    for item in error.errors(include_url=False):
        loc = item["loc"]
        message = _message(item)
        if loc and loc[-1] == "[key]":  # a bad dict key, e.g. an unknown modality in data.synthetic.mix
            loc, message = loc[:-1], f"invalid key: {message}"
        path = ".".join(str(part) for part in loc)
        problems.append(_problem(_locate(loc, locations), path, message))
    return problems


def _message(item: Any) -> str:
    if item["type"] == "extra_forbidden":
        return _unknown_key_message(item["loc"])
    if item["type"] == "missing":
        return "missing required key"
    message = item["msg"].removeprefix("Value error, ")
    given = item.get("input")
    if isinstance(given, (str, int, float, bool)) and item["type"] not in ("value_error", "assertion_error"):
        message += f" (got {given!r:.60})"
    return message


def _unknown_key_message(loc: tuple) -> str:
    section = _model_at(loc[:-1])
    if section is None:
        return "unknown key"
    allowed = list(section.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown key (allowed: {', '.join(allowed)}){hint}"


def _annotation_at(loc: tuple) -> Any:
    """The schema's type at `loc` (None where the schema has no such field), through list items and dict values."""
    annotation: Any = Recipe
    for part in loc:
        annotation = _without_none(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(str(part))
            if field is None:
                return None
            annotation = field.annotation
        elif typing.get_origin(annotation) in (list, tuple) and typing.get_args(annotation):
            annotation = typing.get_args(annotation)[0]
        elif typing.get_origin(annotation) is dict:
            annotation = typing.get_args(annotation)[1]
        else:
            return None
    return _without_none(annotation)


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The schema model of the section at `loc`, walking through list items and dict values."""
    annotation = _annotation_at(loc)
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _is_section(path: str) -> bool:
    """Whether the schema field at dotted `path` is a section of named fields (a model), not a value."""
    return _model_at(tuple(path.split("."))) is not None


def _is_list(path: str) -> bool:
    return typing.get_origin(_annotation_at(tuple(path.split(".")))) is list


def _without_none(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(members) == 1:
            return members[0]
    return annotation


def _locate(loc: tuple, locations: Locations) -> str | None:
    """Where the deepest known ancestor of `loc` was written; a missing key points at its section."""
    for depth in range(len(loc), -1, -1):
        found = locations.get(".".join(str(part) for part in loc[:depth]))
        if found:
            return found
    return None


# --- small helpers --------------------------------------------------------------------------------------


def _problem(where: str | None, path: str, message: str) -> str:
    return ": ".join(part for part in (where, path, message) if part)


def _join(prefix: str, key: object) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _is_within(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", type(None): "null"}.get(
        type(value), f"a {type(value).__name__}"
    )


class _ReadableDumper(yaml.SafeDumper):
    """Writes lists of scalars (betas, freeze) inline as a person would, and never emits anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_list(dumper: yaml.SafeDumper, items: list) -> yaml.Node:
    inline = all(not isinstance(item, (dict, list)) for item in items)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=inline)


_ReadableDumper.add_representer(list, _represent_list)


def _flatten_into(flat: dict[str, str], prefix: str, value: Any) -> None:
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            _flatten_into(flat, _join(prefix, name), getattr(value, name))
    elif isinstance(value, (list, tuple)) and any(isinstance(item, BaseModel) for item in value):
        for index, item in enumerate(value):
            _flatten_into(flat, _join(prefix, index), item)
    elif isinstance(value, dict) and any(isinstance(item, BaseModel) for item in value.values()):
        for key, item in value.items():
            _flatten_into(flat, _join(prefix, key), item)
    elif isinstance(value, str):
        flat[prefix] = value
    else:
        flat[prefix] = json.dumps(value, separators=(",", ":"))
