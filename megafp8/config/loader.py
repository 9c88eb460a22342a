"""Strict YAML loading onto the config dataclasses, dotted command-line overrides, name resolution.

Loading order: YAML file -> dotted overrides merged on top, one after another -> `model.size` expanded under the
explicit model keys -> dataclasses built strictly (unknown keys, keys that moved and wrong types are errors)
-> cross-field validation.

A section of several kinds (`model.attention`) is built as the dataclass its `kind` names. When a later layer
(an override over the file or over an earlier override, the file or an override over the named size) gives it
another kind, the earlier layers' settings that the new kind lacks are dropped: `--config tiny_dense
model.attention.kind=mla` needs no word about the size's `num_kv_heads`.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from megafp8.config.errors import ConfigError
from megafp8.config.fields import KindedSection
from megafp8.config.schema import Config, ModelConfig, upgrade_saved_model
from megafp8.config.sizes import MODEL_SIZES
from megafp8.config.validate import validate_config

# Where a bare `--config NAME` is looked for: the working directory's configs/, then the repo's.
REPO_CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def config_search_dirs() -> list[Path]:
    dirs = [Path.cwd() / "configs", REPO_CONFIG_DIR]
    return list(dict.fromkeys(d.resolve() for d in dirs))


def available_configs() -> list[str]:
    names = set()
    for d in config_search_dirs():
        if d.is_dir():
            names.update(p.name for p in d.glob("*.yaml"))
    return sorted(names)


def resolve_config_path(name: str) -> Path:
    """A path as given, else `configs/NAME` or `configs/NAME.yaml` in the search directories."""
    if not name.strip():  # Path("") is the working directory, which the check below would call a directory given
        raise ConfigError(f"the config name is empty: give a file or one of {', '.join(available_configs())}")
    candidate = Path(name)
    if candidate.is_file():
        return candidate
    if candidate.is_dir():
        yamls = sorted(p.name for p in candidate.glob("*.yaml"))
        raise ConfigError(f"config '{name}' is a directory; give one of its files"
                          + (f" ({', '.join(yamls[:8])}{', ...' if len(yamls) > 8 else ''})" if yamls else ""))
    for d in config_search_dirs():
        for fname in (name, f"{name}.yaml"):
            if (d / fname).is_file():
                return d / fname
    known = available_configs()
    close = difflib.get_close_matches(Path(name).name, known, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ConfigError(
        f"config '{name}' not found: it is not a file and not a name in "
        f"{', '.join(str(d) for d in config_search_dirs())}.{hint} Available: {', '.join(known) or 'none'}."
    )


def repeated_overrides(overrides: list[str]) -> list[str]:
    """One warning line for each key that `overrides` gives more than once, in the order of first appearance,
    naming every value and the one used (the last: a later override replaces an earlier one, which lets a wrapper
    script put its defaults before its user's overrides). [] where each key is given once."""
    given: dict[str, list[str]] = {}
    for item in overrides:
        key, sep, _ = item.partition("=")
        if sep:
            given.setdefault(key.strip(), []).append(item)
    return [f"override {key} is given {len(items)} times ({', '.join(items)}): {items[-1]} is used"
            for key, items in given.items() if len(items) > 1]


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`["model.num_layers=4", "optimizer.lr=1e-3"]` -> a nested dict; values parsed as YAML scalars."""
    nested: dict[str, Any] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override '{item}' is not of the form section.key=value (e.g. model.num_layers=4)")
        try:
            value = yaml.safe_load(text) if text != "" else ""
        except yaml.YAMLError as err:
            raise ConfigError(_unreadable_value(item, key, text, err)) from None
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}' sets a key below '{part}', which is a value, not a section")
        node[parts[-1]] = value
    return nested


def _unreadable_value(item: str, key: str, text: str, err: yaml.YAMLError) -> str:
    """What is wrong with override `item`, whose value is not YAML, and how to write it. A list setting given a value
    that opens a list (`data.paths=[a,b`) is a list written wrong: quotes, the advice for a string, would make it a
    one-item list of that text."""
    if text.lstrip().startswith("[") and _is_list_setting(key):
        return (f"override '{item}': {key} is a list, and this value is not a valid YAML list ({yaml_problem(err)}): "
                f"write it as '{key}=[a, b]', its items between [ and ] separated by commas, an item holding YAML's "
                "special characters (e.g. * : # ,) in double quotes")
    return (f"override '{item}': its value is not valid YAML ({yaml_problem(err)}); a string with YAML's special "
            f"characters goes in quotes inside the shell's: '{key}=\"{text}\"'")


def _setting_type(cls: Any, parts: list[str]) -> Any:
    """The annotated type of the setting at dotted `parts` below config dataclass `cls` (in any kind of a section of
    several kinds), or None where there is none."""
    if _is_kinded(cls):
        found = (_setting_type(kind, parts) for kind in cls.kinds().values())
        return next((tp for tp in found if tp is not None), None)
    tp = _hints(cls).get(parts[0]) if dataclasses.is_dataclass(cls) else None
    return tp if tp is None or len(parts) == 1 else _setting_type(tp, parts[1:])


def _is_list_setting(key: str) -> bool:
    """Whether dotted `key` names a setting whose value is a list (or may be one: `list[str] | None`)."""
    tp = _setting_type(Config, key.split("."))
    options = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
    return any(typing.get_origin(option) is list for option in options)


def _is_kinded(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, KindedSection)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The evaluated field annotations of a config dataclass (evaluating them is most of a config's loading time)."""
    return typing.get_type_hints(cls)


@functools.cache
def _sections(cls: type) -> dict[str, tuple[Any, Any]]:
    """(annotated type, default kind or None) of each field of dataclass `cls` that is a section."""
    hints = _hints(cls)
    return {f.name: (hints[f.name], f.default_factory().kind if _is_kinded(hints[f.name]) else None)
            for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name]) or _is_kinded(hints[f.name])}


def _kept_for_kind(base: type, below: dict[str, Any], top: dict[str, Any], default_kind: str) -> dict[str, Any]:
    """`below`'s settings of a kinded section that `top` merges into: all of them if `top` keeps the kind, else
    those the new kind also has."""
    old = below.get("kind", default_kind)
    new = top.get("kind", old)
    if new == old:
        return below
    kind_cls = base.kinds().get(new)
    keep = {f.name for f in dataclasses.fields(kind_cls)} if kind_cls else set()
    return {k: v for k, v in below.items() if k in keep and k != "kind"}


def merge(base: dict[str, Any], top: dict[str, Any], cls: type | None = None) -> dict[str, Any]:
    """Recursive dict merge; `top` wins. With `cls`, the dataclass the dicts describe, a section of several kinds to
    which `top` gives another kind keeps only `base`'s settings that the new kind has."""
    out = dict(base)
    sections = _sections(cls) if cls is not None else {}
    for key, value in top.items():
        below = out.get(key)
        if isinstance(value, dict) and isinstance(below, dict):
            tp, default_kind = sections.get(key, (None, None))
            if default_kind is not None:
                below, tp = _kept_for_kind(tp, below, value, default_kind), None
            out[key] = merge(below, value, tp)
        else:
            out[key] = value
    return out


def expand_model_size(raw: dict[str, Any]) -> dict[str, Any]:
    """Fill model keys from `model.size` without overriding any key given explicitly."""
    model = raw.get("model")
    if not isinstance(model, dict) or model.get("size") is None:
        return raw
    size = model["size"]
    if size not in MODEL_SIZES:
        close = difflib.get_close_matches(str(size), MODEL_SIZES, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"model.size: unknown size '{size}'.{hint} Known sizes: {', '.join(MODEL_SIZES)}.")
    return {**raw, "model": merge(MODEL_SIZES[size], model, ModelConfig)}


def type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotated type `tp`; the only conversions are int->float and '3e-4'->float."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
    elif origin is Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return value
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"{key}: '{value}' is not one of {type_name(tp)}{hint}")
    elif origin is list:
        (item_type,) = typing.get_args(tp)
        if isinstance(value, list):
            return [_coerce(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, str) and item_type is str:
            return [value]  # `key=pattern` on the command line means a one-element list
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        _refuse_integral_spelling(key, value)
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            # PyYAML reads `3e-4` (no dot) as a string; accept it as the float everyone means.
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and not math.isfinite(number):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        if number is not None:
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"config field {key} has unsupported type {tp!r}")
    raise ConfigError(f"{key}: expected {type_name(tp)}, got {type(value).__name__} ({value!r})")


def _refuse_integral_spelling(key: str, value: Any) -> None:
    """An int setting written as a whole float (`1e3`, which PyYAML reads as a string, or `1000.0`): one line that
    says how to write it. Other values fall through to the type error."""
    if isinstance(value, bool) or not isinstance(value, (str, float)):
        return
    try:
        number = float(value)
    except ValueError:
        return
    if math.isfinite(number) and number == int(number):
        raise ConfigError(f"{key}: expected int, got {type(value).__name__} ({value!r}): write it as {int(number)}")


def _moved_keys(cls: type, raw: dict[str, Any], prefix: str) -> None:
    """One ConfigError naming the new place of every key of `raw` that has moved (`cls.moved`, or a section of
    several kinds given as its kind's name)."""
    renamed = getattr(cls, "moved", {})
    kinds = {key: tp.kinds() for key, (tp, default_kind) in _sections(cls).items() if default_kind is not None}
    moved = []
    for key, value in raw.items():  # in the order given
        if key in renamed:
            moved.append((f"{prefix}{key}", f"{prefix}{renamed[key]}"))
        elif isinstance(value, str) and value in kinds.get(key, ()):
            moved.append((f"{prefix}{key}={value}", f"{prefix}{key}.kind={value}"))
    if moved:
        (old, new), more = moved[0], ", ".join(f"{o} -> {n}" for o, n in moved[1:])
        raise ConfigError(f"{old} moved: use {new}" + (f" (and {more})" if more else ""))


def _build_kind(base: type, raw: Any, where: str, default_kind: str, ignore_unknown: bool) -> Any:
    """The dataclass of the kind `raw["kind"]` names (default `default_kind`), built from `raw`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping of keys to values, got {type(raw).__name__} ({raw!r})")
    kinds = base.kinds()
    kind = raw.get("kind", default_kind)
    if kind not in kinds:
        close = difflib.get_close_matches(str(kind), kinds, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"{where}.kind: '{kind}' is not one of {' | '.join(map(repr, kinds))}{hint}")
    settings = {name: {f.name for f in dataclasses.fields(c)} for name, c in kinds.items()}
    for key in raw:
        other = next((name for name, keys in settings.items() if key in keys), None)
        if key not in settings[kind] and other and not ignore_unknown:
            raise ConfigError(f"{where}.{key} is a setting of {where}.kind={other}, not of kind {kind}: remove it, or "
                              f"set {where}.kind={other}")
    return build_dataclass(kinds[kind], raw, f"{where}.", ignore_unknown)


def build_dataclass(cls: type, raw: Any, prefix: str = "", ignore_unknown: bool = False) -> Any:
    """Build `cls` from a dict, strictly: unknown keys name the closest valid key, moved keys their new place;
    wrong types name the field. `ignore_unknown` (a config saved by another version): unknown keys are skipped."""
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping of keys to values, got {type(raw).__name__} ({raw!r})")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    _moved_keys(cls, raw, prefix)
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in fields:
            if ignore_unknown:
                continue
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" Did you mean '{prefix}{close[0]}'?" if close else ""
            raise ConfigError(f"unknown config key '{prefix}{key}'.{hint} Valid keys in {where}: {', '.join(fields)}.")
        tp = hints[key]
        if _is_kinded(tp):
            kwargs[key] = _build_kind(tp, value, f"{prefix}{key}", fields[key].default_factory().kind, ignore_unknown)
        elif dataclasses.is_dataclass(tp):
            kwargs[key] = build_dataclass(tp, value, f"{prefix}{key}.", ignore_unknown)
        else:
            kwargs[key] = _coerce(value, tp, f"{prefix}{key}")
    return cls(**kwargs)


def model_config_from_saved(saved: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from its dict form in a checkpoint or a run directory's config.yaml, written by this version or
    an earlier one (the flat layout is translated: `upgrade_saved_model`); keys this version lacks are ignored,
    missing ones default."""
    return build_dataclass(ModelConfig, upgrade_saved_model(saved), "model.", ignore_unknown=True)


def yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's error in one line: where (1-based line and column: the construct it was reading, else where it
    stopped) and what, e.g. `line 4, column 3: could not find expected ':' (while scanning a simple key)`. Its own
    message spans lines and names the stream "<unicode string>"."""
    problem = getattr(err, "problem", None)
    context = getattr(err, "context", None)
    mark = getattr(err, "context_mark", None) or getattr(err, "problem_mark", None)
    if mark is None or problem is None:
        return " ".join(str(err).split())
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently, so a second
    `model:` section would drop the first's settings)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: keys it merges may be given again here
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"'{key}' is given twice (first on line {seen[key].line + 1}); merge the two into one",
                    key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep)


def read_config_file(path: Path) -> Any:
    """A config file's YAML, with one clear ConfigError for a file that is not UTF-8 text, not valid YAML or gives a
    key twice."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start} is 0x{err.object[err.start]:02x}); a config is "
                          "a YAML file saved as UTF-8") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a directory; give a config file (e.g. {path}/NAME.yaml)") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {yaml_problem(err)}") from None


def load_config(name_or_path: str | os.PathLike | None, overrides: list[str] | None = None) -> Config:
    """Load, override, build and validate a config. `None` means the built-in defaults."""
    raw: dict[str, Any] = {}
    source, file_stem = "defaults", None
    if name_or_path is not None:
        path = resolve_config_path(str(name_or_path))
        source = str(path)
        loaded = read_config_file(path)
        raw = loaded if loaded is not None else {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
        file_stem = path.stem
        raw.setdefault("run_name", file_stem)
    for item in overrides or []:  # one layer each: a later override may change a section's kind
        raw = merge(raw, parse_overrides([item]), Config)
    raw = expand_model_size(raw)
    try:
        _refuse_empty_run_name(raw.get("run_name"), file_stem)
        cfg = build_dataclass(Config, raw)
        validate_config(cfg)
    except ConfigError as err:
        raise ConfigError(f"{err} [config: {source}{' + command-line overrides' if overrides else ''}]") from None
    return cfg


def _refuse_empty_run_name(name: Any, file_stem: str | None) -> None:
    """A run_name given empty (`run_name=` on the command line, `run_name: ""` in the file): the printed config said
    '' while the run wrote into `<logging.output_dir>/run`. Only a run_name left out takes the file's name."""
    if isinstance(name, str) and not name.strip():
        fallback = f" to name the run after its config file ({file_stem})" if file_stem else ""
        raise ConfigError(f"run_name={name!r} is empty: give the run a name (run_name=NAME), or leave run_name "
                          f"out{fallback}")


def flat_settings(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict as `{"section.key": value}` (for comparing two configs setting by setting)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat_settings(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config (for saving next to a run or a checkpoint)."""
    return dataclasses.asdict(cfg)


def dump_config(cfg: Any) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
