"""Isolation tiers in the spec (issue 21): ``isolation`` picks a backend, agrees with a
named one, and a stored spec says the tier it runs in. Pure functions of dsec.wire.spec;
the doors (SDK, REST, gateway, CLI) are tested in tests/test_isolation_doors.py."""

from __future__ import annotations

import typing

import msgspec
import pytest

from dsec.edge.backends import known_backends, make_backend
from dsec.errors import InvalidArgument
from dsec.wire.spec import (
    BACKEND_ISOLATION,
    QUOTA_TIER,
    TIER_BACKENDS,
    BackendName,
    Isolation,
    SandboxSpec,
    backend_for,
    check_isolation,
    isolation_of,
    quota_tier,
    resolve,
    stored,
)


def test_every_tier_has_its_backend_and_every_backend_but_fncall_a_tier() -> None:
    assert set(TIER_BACKENDS) == set(typing.get_args(Isolation)) == {
        "container", "gvisor", "vm"}
    for tier, backend in TIER_BACKENDS.items():
        assert backend in typing.get_args(BackendName)
        assert BACKEND_ISOLATION[backend] == tier      # a tier's backend gives that tier
    assert set(typing.get_args(BackendName)) - set(BACKEND_ISOLATION) == {"fncall"}
    assert {"gvisor", "vm"} <= set(known_backends())


def test_tier_quotas_count_every_backend_in_a_tier() -> None:
    """Red team 21, B6: a backend in no tier is still counted in one by tier quotas
    (fncall, a process on the host kernel: the container tier), so no backend is outside
    every tier quota; a backend's own tier is the one it counts in when it has one."""
    assert set(QUOTA_TIER) == set(typing.get_args(BackendName))
    for backend in typing.get_args(BackendName):
        assert quota_tier(backend) == BACKEND_ISOLATION.get(backend, "container")
    assert quota_tier("fncall") == "container"
    assert quota_tier("some-future-backend") == "container"


@pytest.mark.parametrize(("isolation", "default", "want"), [
    (None, "simulated", "simulated"), (None, "fncall", "fncall"),
    ("container", "simulated", "simulated"),   # a simulated cluster answers "container"
    ("container", "runc", "runc"),             # the default keeps its runtime in its tier
    ("container", "fncall", "container"), ("container", "vm", "container"),
    ("gvisor", "simulated", "gvisor"), ("gvisor", "container", "gvisor"),
    ("vm", "container", "vm"), ("vm", "vm", "vm")])
def test_the_tier_picks_the_backend(isolation: Isolation | None, default: BackendName,
                                    want: BackendName) -> None:
    assert backend_for(isolation, default) == want
    spec = resolve(SandboxSpec(isolation=isolation), backend=default, project="p")
    assert spec.backend == want
    assert spec.isolation == BACKEND_ISOLATION.get(want)
    assert isolation_of(spec) == spec.isolation


def test_a_named_backend_wins_over_the_default_and_sets_the_tier() -> None:
    spec = resolve(SandboxSpec(backend="gvisor").validate(), backend="container",
                   project="p")
    assert (spec.backend, spec.isolation) == ("gvisor", "gvisor")
    both = SandboxSpec(backend="runc", isolation="container").validate()
    assert resolve(both, backend="vm", project="p").backend == "runc"


@pytest.mark.parametrize(("isolation", "backend", "gives"), [
    ("vm", "container", "isolation 'container'"), ("container", "gvisor", "isolation 'gvisor'"),
    ("gvisor", "runc", "isolation 'container'"), ("container", "fncall", "no isolation tier")])
def test_a_tier_and_a_backend_that_disagree_are_refused_naming_both(
        isolation: Isolation, backend: BackendName, gives: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        SandboxSpec(isolation=isolation, backend=backend).validate()
    msg = exc.value.message
    assert f"isolation={isolation!r}" in msg and f"backend={backend!r}" in msg, msg
    assert gives in msg and f"picks backend {TIER_BACKENDS[isolation]!r}" in msg, msg
    assert exc.value.detail["field"] == "isolation"


def test_an_unknown_tier_is_refused_built_or_decoded() -> None:
    with pytest.raises(InvalidArgument, match="isolation='kvm' is invalid: use one of "
                       "'container', 'gvisor', 'vm'"):
        SandboxSpec(isolation="kvm").validate()
    with pytest.raises(InvalidArgument):
        check_isolation(None)
    with pytest.raises(msgspec.ValidationError, match="isolation"):
        msgspec.json.decode(b'{"isolation": "kvm"}', type=SandboxSpec)


def test_a_spec_without_a_tier_encodes_as_before_and_one_with_it_round_trips() -> None:
    # omit_defaults: a spec that says nothing of isolation is byte-identical to one made
    # before the field existed (idempotency fingerprints, stored state)
    assert b"isolation" not in msgspec.msgpack.encode(SandboxSpec(backend="container"))
    spec = SandboxSpec(isolation="vm")
    for enc, dec in ((msgspec.json.encode, msgspec.json.decode),
                     (msgspec.msgpack.encode, msgspec.msgpack.decode)):
        assert dec(enc(spec), type=SandboxSpec) == spec


def test_a_spec_stored_before_tiers_reads_back_with_its_backends_tier() -> None:
    old = msgspec.json.decode(b'{"backend": "container", "project": "p"}', type=SandboxSpec)
    assert old.isolation is None and isolation_of(old) == "container"
    assert stored(old).isolation == "container"
    assert stored(msgspec.json.decode(b"{}", type=SandboxSpec)).isolation == "container"
    fn = stored(SandboxSpec(backend="fncall", project="p"))
    assert fn.isolation is None and isolation_of(fn) is None
    resolved = resolve(SandboxSpec(isolation="vm"), backend="container", project="p")
    assert resolve(resolved, backend="simulated", project="q") is resolved  # already whole


def test_an_unbuilt_tier_backend_is_a_clear_error() -> None:
    # the registry tries dsec.edge.backends.gvisor lazily; until it exists in a build the
    # error says so instead of an ImportError
    try:
        import dsec.edge.backends.gvisor  # noqa: F401
    except ModuleNotFoundError:
        with pytest.raises(InvalidArgument, match="'gvisor'.*not installed in this build"):
            make_backend("gvisor")
    else:
        pytest.skip("by design: the gvisor backend is built in this tree")
