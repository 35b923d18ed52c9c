from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsec.errors import InvalidArgument
from dsec.image.manifest import parse_ref, ref_key
from dsec.image.merge import plan_merges


def test_parse_ref_names_tags_and_digests() -> None:
    assert parse_ref("busybox").name == "busybox"
    assert parse_ref("busybox").tag == "latest"
    assert parse_ref("busybox").namespace is None            # bare: no project given
    r = parse_ref("org/tool:v1.2")
    assert (r.namespace, r.name, r.tag) == ("org", "tool", "v1.2")
    r = parse_ref("org/team/exp-1/tool")                     # nested projects
    assert (r.namespace, r.name, r.tag, r.key) == ("org/team/exp-1", "tool", "latest",
                                                   "org/team/exp-1/tool:latest")
    assert parse_ref("sha256:" + "ab" * 32).digest_hex == "ab" * 32
    assert parse_ref("sha256:abcdef012345").digest_hex == "abcdef012345"


@pytest.mark.parametrize("bad", ["", "UPPER", "a:b:c", "sha256:xyz", "sha256:abc", "../x",
                                 "a/../b", ":tag", "/base", "org//x", "org/", "Org/x",
                                 "a:b/c", "x" * 2000, "-org/x", "org/.x"])
def test_parse_ref_rejects_bad_refs(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_ref(bad)


def test_plan_merges_groups_consecutive_small_layers() -> None:
    assert plan_merges([1, 2, 100, 3, 4, 5, 100, 6], 10) == [(0, 2), (3, 6)]
    assert plan_merges([1, 100, 2], 10) == []
    assert plan_merges([], 10) == []
    assert plan_merges([1, 1], 10) == [(0, 2)]


_part = st.from_regex(r"[a-z0-9][a-z0-9_.-]{0,10}", fullmatch=True)
_name = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,10}", fullmatch=True)
_tag = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,10}", fullmatch=True)


@given(st.none() | st.lists(_part, min_size=1, max_size=4).map("/".join), _name, _tag)
def test_names_spell_one_way_and_parse_back(ns: str | None, name: str, tag: str) -> None:
    # The spelling is unambiguous although project paths nest: everything before the
    # last '/' is the project, names contain no '/'.
    r = parse_ref(ref_key(ns, name, tag))
    assert (r.namespace, r.name, r.tag, r.digest_hex) == (ns, name, tag, None)
    assert r.key == ref_key(ns, name, tag)
