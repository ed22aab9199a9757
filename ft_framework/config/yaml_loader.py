"""The YAML reader for configs and override values, safe against what a hostile or careless file
holds: a key given twice in one mapping is refused (naming it and both places), aliases may add at
most ALIAS_NODE_LIMIT nodes to a document, counted while the document is composed, before anything
is constructed or expanded (a "billion laughs" bomb stops after a few of its aliases), and no value
nests deeper than user_files.NESTING_LIMIT (3000 nested `[` would exhaust Python's recursion in
PyYAML's composer). It builds on PyYAML's SafeLoader: plain data only, never objects.

Duplicate keys are looked for in every mapping of the document as written, before anything is
constructed; a key that overrides a merged one is YAML's merge semantics, not a duplicate.

Merge keys (`<<: *base`, `<<: [*a, *b]`) are ours, not PyYAML's: PyYAML 6.0.4 changed what a nested
merge means (a merged mapping's own key lost to the key it merged in: yaml/pyyaml#953), so the same
file meant two configs on two machines. This module resolves merges itself, by the merge key's
specification (yaml.org/type/merge.html), on every PyYAML release we allow:

- a mapping's own keys win over the keys it merges in;
- of a list of merged mappings, an earlier one wins over a later one;
- a merged mapping's own merges are resolved first (the rules again, inside it);
- `<<` given twice in one mapping is a duplicate key, like any other; a merged value that is not a
  mapping (or a list of mappings) is an error naming where.

Only the parser and the composer (events, nodes, anchors and aliases) are PyYAML's; they follow
the YAML 1.1 grammar, which PyYAML has not changed in years, and tests/unit/config/test_yaml_versions.py
runs this module's tests under the oldest and the newest PyYAML we allow.

    data = load_yaml(text)          # raises DuplicateKey / AliasLimit / NestingLimit / yaml.YAMLError
"""

from __future__ import annotations

import re
from typing import IO, Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from ft_framework.user_files import NESTING_LIMIT

__all__ = ["ALIAS_NODE_LIMIT", "AliasLimit", "DuplicateKey", "NestingLimit", "load_yaml", "marks_text"]

# The most nodes that aliases may add to one document, each alias counting every node of what it
# repeats. A config that reuses a block a few times stays far below; the 9x9 bomb passes it at its
# third level, where one alias repeats 91 nodes.
ALIAS_NODE_LIMIT = 1000

_MERGE_TAG = "tag:yaml.org,2002:merge"
# YAML 1.1's value key `=`, which SafeLoader reads as the plain string "=".
_VALUE_TAG = "tag:yaml.org,2002:value"
_STR_TAG = "tag:yaml.org,2002:str"


class _MergeKeyName:
    """The merge key as a duplicate-key check sees it: equal only to itself (a quoted "<<" is a
    plain string key), named `<<`."""

    def __str__(self) -> str:
        return "<<"


_MERGE_KEY = _MergeKeyName()


class DuplicateKey(yaml.YAMLError):
    """One mapping gives `key` twice; `first` and `second` are where (PyYAML marks)."""

    def __init__(self, key: str, first: yaml.Mark, second: yaml.Mark):
        super().__init__(f"key {key!r} is given twice")
        self.key, self.first, self.second = key, first, second


class AliasLimit(yaml.YAMLError):
    """An alias would take the document past ALIAS_NODE_LIMIT nodes (or repeats its own parent)."""

    def __init__(self, anchor: str, mark: yaml.Mark, recursive: bool):
        super().__init__(f"alias {anchor!r}")
        self.anchor, self.mark, self.recursive = anchor, mark, recursive


class NestingLimit(yaml.MarkedYAMLError):
    """A value nests deeper than NESTING_LIMIT levels; `problem_mark` is where the level past it opens."""

    def __init__(self, mark: yaml.Mark):
        super().__init__(problem=f"nested deeper than {NESTING_LIMIT} levels (a config nests a few): refused",
                         problem_mark=mark)


def marks_text(first: yaml.Mark, second: yaml.Mark) -> str:
    """``lines 4 and 7``, or ``line 4, columns 3 and 12`` when both are on one line (1-based)."""
    if first.line != second.line:
        return f"lines {first.line + 1} and {second.line + 1}"
    return f"line {first.line + 1}, columns {first.column + 1} and {second.column + 1}"


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader that reads `2e-5` as a float (YAML 1.1 would read it as a string), bounds what
    aliases add, refuses duplicate keys and resolves merge keys itself."""

    def __init__(self, stream: str | IO[str]):
        super().__init__(stream)
        self._expanded_size: dict[int, int] = {}  # id(node) -> its node count with aliases expanded
        self._alias_nodes = 0
        self._depth = 0
        self._merged: dict[int, list[tuple[Node, Node]]] = {}  # id(mapping node) -> its pairs, merges resolved

    # --- composing: the alias bound -----------------------------------------------------------
    def compose_node(self, parent: Node | None, index: Any) -> Node:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            node = super().compose_node(parent, index)  # the anchored node itself, shared
            size = self._expanded_size.get(id(node))
            if size is None:  # still being composed: the alias sits inside what it names
                raise AliasLimit(event.anchor, event.start_mark, recursive=True)
            self._alias_nodes += size
            if self._alias_nodes > ALIAS_NODE_LIMIT:
                raise AliasLimit(event.anchor, event.start_mark, recursive=False)
            return node
        self._depth += 1
        if self._depth > NESTING_LIMIT:
            raise NestingLimit(self.peek_event().start_mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if isinstance(node, SequenceNode):
            children = node.value
        elif isinstance(node, MappingNode):
            children = [child for pair in node.value for child in pair]
        else:
            children = []
        self._expanded_size[id(node)] = 1 + sum(self._expanded_size[id(child)] for child in children)
        return node

    # --- constructing: duplicate keys, looked for before anything is constructed ------------------
    def construct_document(self, node: Node) -> Any:
        self._refuse_duplicate_keys(node)
        return super().construct_document(node)

    def _refuse_duplicate_keys(self, root: Node) -> None:
        """Raises DuplicateKey for the first mapping of the document, in document order, that gives a key
        twice, named by its dotted path (a node shared through an alias: the path where it is defined).
        Every mapping as written: PyYAML rewrites one holding a merge (`<<`) in place once it constructs
        it, and a key overriding a merged one is no duplicate. Each node once, without recursion."""
        pending: list[tuple[Node, str]] = [(root, "")]
        visited: set[int] = set()
        while pending:
            node, prefix = pending.pop()
            if id(node) in visited:
                continue
            visited.add(id(node))
            if isinstance(node, MappingNode):
                seen: dict[Any, Node] = {}
                for key_node, _ in node.value:
                    if key_node.tag == _MERGE_TAG:
                        key = _MERGE_KEY
                    elif key_node.tag == _VALUE_TAG:
                        key = key_node.value
                    else:
                        key = self.construct_object(key_node, deep=True)
                    try:
                        first = seen.setdefault(key, key_node)
                    except TypeError:  # an unhashable key: SafeLoader's own error says so
                        continue
                    if first is not key_node:
                        raise DuplicateKey(f"{prefix}{key}", first.start_mark, key_node.start_mark)
                children = [(value, f"{prefix}{key.value if isinstance(key, ScalarNode) else '?'}.")
                            for key, value in node.value]
            elif isinstance(node, SequenceNode):
                children = [(child, prefix) for child in node.value]
            else:
                children = []
            pending.extend(reversed(children))  # the first child is taken next: document order

    # --- constructing: merge keys, by the merge specification ---------------------------------------
    def construct_mapping(self, node: Node, deep: bool = False) -> dict[Any, Any]:
        """The mapping `node` holds, its merges resolved (module docstring); the later of two equal
        keys in the resolved pairs wins, so they list what is merged in before the mapping's own."""
        if not isinstance(node, MappingNode):
            raise ConstructorError(None, None, f"expected a mapping node, but found {node.id}", node.start_mark)
        mapping: dict[Any, Any] = {}
        for key_node, value_node in self._merged_pairs(node):
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                raise ConstructorError("while constructing a mapping", node.start_mark, "found unhashable key",
                                       key_node.start_mark) from None
            mapping[key] = self.construct_object(value_node, deep=deep)
        return mapping

    def _merge_sources(self, node: MappingNode) -> list[MappingNode]:
        """The mappings `node` merges in, the one that wins first."""
        sources: list[MappingNode] = []
        for key_node, value_node in node.value:
            if key_node.tag != _MERGE_TAG:
                continue
            if isinstance(value_node, MappingNode):
                sources.append(value_node)
            elif isinstance(value_node, SequenceNode):
                for item in value_node.value:
                    if not isinstance(item, MappingNode):
                        raise ConstructorError("while constructing a mapping", node.start_mark,
                                               f"expected a mapping for merging, but found {item.id}",
                                               item.start_mark)
                    sources.append(item)
            else:
                raise ConstructorError("while constructing a mapping", node.start_mark,
                                       f"expected a mapping or list of mappings for merging, but found "
                                       f"{value_node.id}", value_node.start_mark)
        return sources

    def _merged_pairs(self, root: MappingNode) -> list[tuple[Node, Node]]:
        """`root`'s (key, value) pairs with every merge resolved: the merged mappings' pairs, the last
        source's first, then `root`'s own, so that a dict built in this order lets the winner write
        last. Nodes are read, never changed (an anchored mapping merged in twice reads the same), each
        mapping resolved once (memoised by node), without recursion: merges nest as deep as the
        document does (NESTING_LIMIT)."""
        memo = self._merged
        pending: list[tuple[MappingNode, bool]] = [(root, False)]
        resolving: set[int] = set()
        while pending:
            node, sources_done = pending.pop()
            if id(node) in memo:
                continue
            sources = self._merge_sources(node)
            if not sources_done:
                if id(node) in resolving:  # the composer refuses an alias inside what it names: unreachable
                    raise ConstructorError("while constructing a mapping", node.start_mark,
                                           "a mapping merges itself in", node.start_mark)
                resolving.add(id(node))
                pending.append((node, True))
                pending.extend((source, False) for source in reversed(sources) if id(source) not in memo)
                continue
            pairs: list[tuple[Node, Node]] = []
            for source in reversed(sources):
                pairs.extend(memo[id(source)])
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue
                if key_node.tag == _VALUE_TAG:
                    key_node = ScalarNode(_STR_TAG, key_node.value, key_node.start_mark, key_node.end_mark)
                pairs.append((key_node, value_node))
            memo[id(node)] = pairs
        return memo[id(root)]

    def construct_yaml_int(self, node: ScalarNode) -> int:
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # Python reads at most sys.get_int_max_str_digits() digits (4300)
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {len(node.value)} characters is longer than Python reads",
                node.start_mark) from None


_ConfigLoader.add_constructor("tag:yaml.org,2002:int", _ConfigLoader.construct_yaml_int)
_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def load_yaml(source: str | IO[str]) -> Any:
    """One YAML document as plain data. Raises DuplicateKey, AliasLimit, or another yaml.YAMLError."""
    loader = _ConfigLoader(source)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
