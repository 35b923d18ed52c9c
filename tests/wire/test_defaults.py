"""A sandbox's default size is said once (``dsec.wire.spec.DEFAULT_*``): every place that
offers a default (the spec, the API's create body, the registry record, the SDK's and
the CLI's keywords) must give the same one, or a sandbox's size would depend on the door
it was created through."""

from __future__ import annotations

import inspect

import msgspec

from dsec.cli.sandbox import create as cli_create
from dsec.client.core import AsyncSandboxes, parse_memory
from dsec.client.sync import Sandboxes
from dsec.control.records import SandboxRecord
from dsec.wire.api import CreateSandboxRequest
from dsec.wire.spec import (
    DEFAULT_CPU_MILLI,
    DEFAULT_MEMORY_BYTES,
    DEFAULT_PIDS_MAX,
    SandboxSpec,
)


def test_the_records_default_to_the_one_size() -> None:
    for made in (SandboxSpec(), CreateSandboxRequest(),
                 SandboxRecord(id="e0-x", node="e0", project="p")):
        assert made.cpu_milli == DEFAULT_CPU_MILLI, type(made)
        assert made.memory_bytes == DEFAULT_MEMORY_BYTES, type(made)
    assert SandboxSpec().pids_max == DEFAULT_PIDS_MAX
    assert CreateSandboxRequest().pids_max == DEFAULT_PIDS_MAX


def test_a_spec_at_its_defaults_omits_them_on_the_wire() -> None:
    # omit_defaults compares with these values: an explicit default and an absent field
    # are one spec on the wire (stored specs and idempotency fingerprints rely on it)
    explicit = SandboxSpec(cpu_milli=DEFAULT_CPU_MILLI, memory_bytes=DEFAULT_MEMORY_BYTES,
                           pids_max=DEFAULT_PIDS_MAX)
    assert msgspec.msgpack.encode(explicit) == msgspec.msgpack.encode(SandboxSpec())


def test_the_sdk_keywords_default_to_the_one_size() -> None:
    for fn in (AsyncSandboxes.create, AsyncSandboxes.create_many, Sandboxes.create):
        p = inspect.signature(fn).parameters
        assert round(p["cpu"].default * 1000) == DEFAULT_CPU_MILLI, fn
        assert parse_memory(p["memory"].default) == DEFAULT_MEMORY_BYTES, fn
        assert p["pids_max"].default == DEFAULT_PIDS_MAX, fn


def test_the_cli_defaults_to_the_one_size() -> None:
    opts = {p.name: p.default for p in cli_create.params}
    assert round(float(opts["cpu"]) * 1000) == DEFAULT_CPU_MILLI
    assert parse_memory(str(opts["memory"])) == DEFAULT_MEMORY_BYTES
