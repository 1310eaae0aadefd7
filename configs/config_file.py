"""YAML file + `--set KEY=VALUE` overrides -> a validated `Config`.

Every failure is a ConfigError whose message starts with the file name and names the
dotted key, so an operator can fix it without reading code.
"""

from __future__ import annotations

import difflib
import logging
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from meshserve.configs.auto_choice import choose_auto
from meshserve.configs.errors import ConfigError
from meshserve.configs.schema import SECRET_KEYS, Config

BUILTIN_SOURCE = "<builtin default>"


def parse_override(item: str) -> tuple[list[str], Any]:
    """`scheduler.max_num_seqs=64` -> (["scheduler", "max_num_seqs"], 64). The value is YAML."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set parallel.tensor=2")
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {item!r}: value is not valid YAML ({e.problem})") from None
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {'.'.join(path[: i + 1])} is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def _dotted(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc) or "<top>"


def _describe(err: dict[str, Any]) -> str:
    where = _dotted(err["loc"])
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown key{_suggestion(err['loc'])}"
    given = err.get("input")
    secret = len(err["loc"]) >= 2 and err["loc"][0] == "server" and err["loc"][1] in SECRET_KEYS
    shown = "" if isinstance(given, dict) or secret else f" (got {given!r})"
    return f"{where}: {err['msg']}{shown}"


def _suggestion(loc: tuple[Any, ...]) -> str:
    """` (did you mean scheduler.max_num_seqs?)` for a misspelt key, or the section's keys."""
    section: type[BaseModel] = Config
    for part in loc[:-1]:
        field = section.model_fields.get(str(part))
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return ""
        section = field.annotation
    known = list(section.model_fields)
    prefix = "".join(f"{p}." for p in loc[:-1])
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
    if close:
        return f" (did you mean {prefix}{close[0]}?)"
    return f" (the keys of {prefix.rstrip('.') or 'the top level'}: {', '.join(known)})"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read and validate the configuration tree (not yet checked against the model:
    see `meshserve.configs.validate.check_config`)."""
    source = str(path) if path else BUILTIN_SOURCE
    data: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{source}: no such config file")
        try:
            loaded = yaml.safe_load(p.read_text())
        except UnicodeDecodeError:
            raise ConfigError(f"{source}: not a YAML config (not even text); a GGUF model is served with "
                              f"`meshserve serve FILE.gguf`") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{source}: not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(loaded).__name__}")
        data = loaded or {}
    try:
        data = apply_overrides(data, overrides or [])
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    config = _validate(data, source)
    if config.model.quantization == "auto":
        chosen, line = choose_auto(config)
        logging.getLogger("meshserve").info("%s", line)
        config = _validate(apply_overrides(data, chosen.overrides()), source)
    return config


def _validate(data: dict[str, Any], source: str) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        lines = [_describe(err) for err in e.errors()]
        raise ConfigError(f"{source}: " + "; ".join(lines)) from None
