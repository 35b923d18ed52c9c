from __future__ import annotations

import pytest

from dsec.errors import InvalidArgument
from dsec.image.manifest import parse_ref
from dsec.image.merge import plan_merges


def test_parse_ref_names_tags_and_digests() -> None:
    assert parse_ref("busybox").name == "busybox"
    assert parse_ref("busybox").tag == "latest"
    r = parse_ref("org/tool:v1.2")
    assert (r.name, r.tag) == ("org/tool", "v1.2")
    assert parse_ref("sha256:" + "ab" * 32).digest_hex == "ab" * 32
    assert parse_ref("sha256:abcdef012345").digest_hex == "abcdef012345"


@pytest.mark.parametrize("bad", ["", "UPPER", "a:b:c", "sha256:xyz", "sha256:abc", "../x",
                                 "a/../b", ":tag"])
def test_parse_ref_rejects_bad_refs(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_ref(bad)


def test_plan_merges_groups_consecutive_small_layers() -> None:
    assert plan_merges([1, 2, 100, 3, 4, 5, 100, 6], 10) == [(0, 2), (3, 6)]
    assert plan_merges([1, 100, 2], 10) == []
    assert plan_merges([], 10) == []
    assert plan_merges([1, 1], 10) == [(0, 2)]
