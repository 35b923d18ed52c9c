"""``role_on``: the one rule for which role a principal holds on a project, used by the
apiserver's ``Caller`` and by IAM alike."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dsec.wire.api import ROLE_RANK, Role, role_on

ROLES: tuple[Role, ...] = ("reader", "member", "admin")


def test_roles_inherit_downward_and_the_strongest_wins() -> None:
    roles: dict[str, Role] = {"org": "reader", "org/team": "admin", "org/team/exp": "member"}
    assert role_on(roles, "org") == "reader"
    assert role_on(roles, "org/team") == "admin"
    assert role_on(roles, "org/team/exp") == "admin"       # admin inherited beats member
    assert role_on(roles, "org/other") == "reader"
    assert role_on(roles, "elsewhere") is None


def test_a_role_covers_whole_path_segments_only() -> None:
    # a binding on "org/te" is not one on "org/team" (nor is "org" on "organisation")
    assert role_on({"org/te": "admin"}, "org/team") is None
    assert role_on({"org": "admin"}, "organisation") is None
    assert role_on({"org/team": "member"}, "org") is None   # never upward


def test_a_superuser_is_admin_everywhere() -> None:
    assert role_on({}, "any/project", superuser=True) == "admin"
    assert role_on({"any": "reader"}, "any", superuser=True) == "admin"


_segment = st.sampled_from(["a", "b", "ab"])
_path = st.lists(_segment, min_size=1, max_size=4).map("/".join)


@given(st.dictionaries(_path, st.sampled_from(ROLES), max_size=6), _path)
def test_role_on_is_the_strongest_binding_on_an_ancestor(roles: dict[str, Role],
                                                         project: str) -> None:
    parts = project.split("/")
    ancestors = {"/".join(parts[: i + 1]) for i in range(len(parts))}
    held = [r for p, r in roles.items() if p in ancestors]
    want = max(held, key=ROLE_RANK.__getitem__) if held else None
    assert role_on(roles, project) == want
