"""YAML a person hands in (run configs, deployment configs, override values), read safely and bounded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pipeline.config_base import ConfigError, resolve_project_path
from pipeline.user_files import UserFile

# A run config has a few hundred YAML nodes. Aliases let a few lines expand into billions ("billion
# laughs"), which validation, error messages and config.json would each walk in full: refused beforehand.
MAX_YAML_NODES = 100_000


def _refuse_expanding_aliases(root: yaml.Node, source: str) -> None:
    """ConfigError when the node tree, with every alias expanded, holds more than MAX_YAML_NODES nodes.
    Stops counting there, so a bomb (or an alias that refers to itself) costs at most that many steps."""
    pending, count = [root], 0
    while pending:
        node = pending.pop()
        count += 1
        if count > MAX_YAML_NODES:
            raise ConfigError(
                f"{source} expands to more than {MAX_YAML_NODES} YAML nodes (anchors and aliases repeating "
                "one another, or an alias inside itself): refused unread"
            )
        if isinstance(node, yaml.SequenceNode):
            pending.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            pending.extend(part for pair in node.value for part in pair)


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error on one line: what is wrong and where (PyYAML's own text quotes the input over several)."""
    if isinstance(err, yaml.MarkedYAMLError) and err.problem:
        mark = err.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        return f"{err.context + ', ' if err.context else ''}{err.problem}{where}"
    return " ".join(str(err).split())


def parse_yaml(text: str, source: str) -> Any:
    """The YAML document in `text`, safely loaded (bounded as _refuse_expanding_aliases says); ConfigError
    naming `source` when it is not YAML."""
    loader = None
    try:
        loader = yaml.SafeLoader(text)
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_expanding_aliases(node, source)
        return loader.construct_document(node)
    except yaml.YAMLError as err:
        raise ConfigError(f"{source} is not valid YAML: {_yaml_problem(err)}") from err
    except RecursionError as err:
        raise ConfigError(f"{source} nests its YAML too deeply") from err
    finally:
        if loader is not None:
            loader.dispose()


def read_yaml_file(path: str | Path, what: str = "config file") -> Any:
    """The YAML document of a config file: ConfigError naming it when it is missing, a directory, not
    UTF-8 text or not YAML."""
    text = UserFile(resolve_project_path(str(path)), what, ConfigError, path).read_text()
    return parse_yaml(text, f"{what} {path}")
