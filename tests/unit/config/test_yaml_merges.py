"""Merge keys mean what the merge key's specification says (yaml.org/type/merge.html), whatever
PyYAML release reads the file: config/yaml_loader.py resolves them itself. PyYAML 6.0.4 changed
nested merges (a merged mapping's own key lost to a key it merged in); these cases are the
specification's own example and the shapes around that change. tests/unit/config/test_yaml_versions.py
runs this file again under the oldest and the newest PyYAML we allow."""

from __future__ import annotations

import pytest
import yaml

from ft_framework.config.yaml_loader import DuplicateKey, load_yaml

# The specification's example: every map after the four anchored ones equals the first of them.
SPEC_EXAMPLE = """\
- &CENTER {x: 1, y: 2}
- &LEFT {x: 0, y: 2}
- &BIG {r: 10}
- &SMALL {r: 1}
- x: 1
  y: 2
  r: 10
  label: center/big
- <<: *CENTER
  r: 10
  label: center/big
- <<: [*CENTER, *BIG]
  label: center/big
- <<: [*BIG, *LEFT, *SMALL]
  x: 1
  label: center/big
"""


def test_the_specifications_example():
    loaded = load_yaml(SPEC_EXAMPLE)
    explicit = {"x": 1, "y": 2, "r": 10, "label": "center/big"}
    assert loaded[:4] == [{"x": 1, "y": 2}, {"x": 0, "y": 2}, {"r": 10}, {"r": 1}]
    assert loaded[4:] == [explicit] * 4


@pytest.mark.parametrize("text, expected", [
    # one merge; the mapping's own key wins
    ("a: &a {p: 1, q: 1}\nb: {<<: *a, p: 2}\n", {"a": {"p": 1, "q": 1}, "b": {"p": 2, "q": 1}}),
    # the own key written before the merge wins as well: order in the mapping does not matter
    ("a: &a {p: 1}\nb: {p: 2, <<: *a}\n", {"a": {"p": 1}, "b": {"p": 2}}),
    # nested: the merged mapping's own key (p: 3) wins over what it merged (p: 1), and an alias of it
    # reads the same (PyYAML 6.0.4 gives c.p = d.p = 1)
    ("a: &a {p: 1}\nc:\n  <<: &b\n    <<: *a\n    p: 3\nd: *b\n", {"a": {"p": 1}, "c": {"p": 3}, "d": {"p": 3}}),
    # three levels, each overriding one key of the level below
    ("l0: &l0 {p: 0, q: 0, r: 0}\nl1: &l1 {<<: *l0, q: 1}\nl2: &l2 {<<: *l1, r: 2}\nl3: {<<: *l2, p: 3}\n",
     {"l0": {"p": 0, "q": 0, "r": 0}, "l1": {"p": 0, "q": 1, "r": 0}, "l2": {"p": 0, "q": 1, "r": 2},
      "l3": {"p": 3, "q": 1, "r": 2}}),
    # a list: the earlier mapping wins over the later one, the own keys over both
    ("x: &x {p: 1, q: 1}\ny: &y {p: 2, r: 2}\nz: {<<: [*x, *y], s: 3}\n",
     {"x": {"p": 1, "q": 1}, "y": {"p": 2, "r": 2}, "z": {"p": 1, "q": 1, "r": 2, "s": 3}}),
    # a list whose mappings merge themselves: each resolved first
    ("x0: &x0 {p: 0, q: 0}\nx: &x {<<: *x0, p: 1}\ny: &y {q: 2, p: 2}\nz: {<<: [*y, *x]}\n",
     {"x0": {"p": 0, "q": 0}, "x": {"p": 1, "q": 0}, "y": {"q": 2, "p": 2}, "z": {"p": 2, "q": 2}}),
    # one anchored mapping merged into two places stays as written, and both read it alike
    ("a: &a {p: 1}\nb: {<<: *a, p: 2}\nc: {<<: *a}\nd: *a\n",
     {"a": {"p": 1}, "b": {"p": 2}, "c": {"p": 1}, "d": {"p": 1}}),
    # an inline merged mapping, no anchor
    ("b: {<<: {p: 1, q: 1}, q: 2}\n", {"b": {"p": 1, "q": 2}}),
    # a merge of an empty mapping, and of an empty list, adds nothing
    ("b: {<<: {}, p: 1}\nc: {<<: [], p: 1}\n", {"b": {"p": 1}, "c": {"p": 1}}),
    # a quoted "<<" is a plain key, not a merge
    ("b: {'<<': 1}\n", {"b": {"<<": 1}}),
    # the same nesting with the override one level deeper
    ("a0: &a0 {p: 1}\nb:\n  <<: &a\n    <<: *a0\n    p: 2\nc: *a\n", {"a0": {"p": 1}, "b": {"p": 2}, "c": {"p": 2}}),
])
def test_merges_resolve_by_the_specification(text, expected):
    assert load_yaml(text) == expected


def test_merges_nest_as_deep_as_a_document_may():
    """Resolved without recursion, so a nesting near the loader's limit merges too."""
    depth = 90
    text = "z: " + "{<<: " * depth + "{p: 1, q: 1}" + ", q: 2}" + "}" * (depth - 1) + "\n"
    assert load_yaml(text) == {"z": {"p": 1, "q": 2}}


def test_merge_given_twice_in_one_mapping_is_a_duplicate_key():
    with pytest.raises(DuplicateKey) as refused:
        load_yaml("a: &a {p: 1}\nb: &b {p: 2}\nc:\n  <<: *a\n  <<: *b\n")
    assert refused.value.key == "c.<<"


@pytest.mark.parametrize("text, found", [
    ("b: {<<: 3}\n", "expected a mapping or list of mappings for merging, but found scalar"),
    ("b: {<<: [{p: 1}, 3]}\n", "expected a mapping for merging, but found scalar"),
])
def test_a_merge_of_something_else_is_an_error_naming_where(text, found):
    with pytest.raises(yaml.constructor.ConstructorError) as refused:
        load_yaml(text)
    assert found in str(refused.value) and "line 1" in str(refused.value)
