"""Reading what users hand us — config, plan and cluster files, ``--set`` values, output paths —
so that every mistake is one clear error naming the file, and no input can hang or exhaust memory.

YAML is read with a safe loader that also understands ``3e-4`` as a float (PyYAML alone reads it
as a string) and refuses documents whose aliases expand to more than :data:`MAX_YAML_VALUES`
values (a "billion laughs" document of 500 bytes would otherwise expand to 10⁹ items).

Example:
    >>> load_yaml("lr: 3e-4", "a --set value")
    {'lr': 0.0003}
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

MAX_FILE_BYTES = 4 << 20  # a config, plan or cluster file larger than this is not one
MAX_YAML_VALUES = 100_000  # scalars + containers after expanding aliases
MAX_SHOWN = 80  # characters of an offending value quoted in an error


class InputError(ValueError):
    """A user-supplied file or value cannot be read; the message names it and the fix."""


def shown(value: Any) -> str:
    """``repr(value)`` cut to a readable length: an error never prints a whole (possibly huge) input."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


def as_tuple(value: Any) -> Any:
    """Lists from JSON/YAML become tuples (nested ones too), so a Plan stays hashable and frozen."""
    if isinstance(value, list):
        return tuple(as_tuple(v) for v in value)
    return value


class _Loader(yaml.SafeLoader):
    """SafeLoader plus floats written without a dot (``1e-3``); no Python tags, as SafeLoader."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*)(?:\.[\d_]*)?[eE][-+]?\d+$"),
    list("-+0123456789"),
)


def _expanded_size(node: yaml.Node, memo: dict[int, int], limit: int) -> int:
    """Values ``node`` becomes with every alias expanded; shared (aliased) nodes are counted once per use."""
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = limit + 1  # a node that contains itself (a recursive alias) is over any limit
    if isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(child, memo, limit) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(k, memo, limit) + _expanded_size(v, memo, limit) for k, v in node.value)
    else:
        size = 1
    memo[id(node)] = min(size, limit + 1)
    return memo[id(node)]


def load_yaml(text: str, source: str) -> Any:
    """Parse YAML ``text`` safely; ``source`` names it in errors ("config 'x.yaml'", "--set a.b=...")."""
    try:
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            if _expanded_size(node, {}, MAX_YAML_VALUES) > MAX_YAML_VALUES:
                raise InputError(
                    f"{source} expands to more than {MAX_YAML_VALUES:,} values (through YAML aliases '*name'): "
                    "write the values out, or remove the aliases."
                )
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        reason = " ".join(str(exc).split())
        raise InputError(f"{source} is not valid YAML: {reason[:300]}") from None
    except RecursionError:
        raise InputError(f"{source} nests too deeply to be a configuration.") from None


def read_text(path: str | Path, what: str) -> str:
    """The UTF-8 text of a small user file; ``what`` names its role ("config file", "Plan file")."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{what} '{path}' does not exist.")
    if not path.is_file():
        raise InputError(f"{what} '{path}' is not a file (a directory?): give the path of the file itself.")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise InputError(f"{what} '{path}' is {size:,} bytes: a {what} is at most {MAX_FILE_BYTES:,} bytes.")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{what} '{path}' cannot be read: {exc.strerror or exc}.") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{what} '{path}' is not UTF-8 text (byte {exc.start} is 0x{data[exc.start]:02x}): "
            "is it the right file? Save it as UTF-8."
        ) from None


def load_yaml_file(path: str | Path, what: str) -> Any:
    """Read and parse a small YAML (or JSON, a subset of YAML) file, errors naming the file."""
    return load_yaml(read_text(path, what), f"{what} '{path}'")


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output_dir(path: str | Path, what: str) -> Path:
    """Refuse a directory we are about to write into that is a file, lies under a file, or is not writable.

    Nothing is created: the check walks up to the nearest existing ancestor.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"{what} '{path}' is a file, not a directory: give a directory (it is created if missing).")
    base = _nearest_existing(path)
    if not base.is_dir():
        raise InputError(f"{what} '{path}' lies under '{base}', which is a file: give a path under a directory.")
    if not os.access(base, os.W_OK | os.X_OK):
        raise InputError(f"{what} '{path}': '{base}' is not writable (read-only or no permission): choose another.")
    return path


def check_output_file(path: str | Path, what: str, force: bool = False, flag: str = "--force") -> Path:
    """Refuse a file we are about to write that is a directory, lies under a file, is unwritable,
    or exists (unless ``force``): an existing file is never overwritten silently."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{what} '{path}' is a directory: give a file name, e.g. '{path / 'out'}'.")
    if path.exists() and not force:
        raise InputError(f"{what} '{path}' already exists: choose another name, or pass {flag} to overwrite it.")
    base = _nearest_existing(path.parent)
    if not base.is_dir():
        raise InputError(f"{what} '{path}' lies under '{base}', which is a file: give a path under a directory.")
    check_output_dir(path.parent, f"{what}'s directory")
    return path
