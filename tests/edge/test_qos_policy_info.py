"""Issue 22 ("not done" before): node info reports the QoS policies the node applies -
CPU pinning and block I/O limits per class (the container backend's), the memory-pressure
relief and the best-effort-only projects - next to what the kernel offers (``qos``)."""

from __future__ import annotations

from dsec.edge.qos import PressurePolicy, parse_class_cpus, parse_class_io, qos_policy_text
from dsec.edge.service import EdgeHandlers
from dsec.wire.node import NodeInfo
from tests.edge.conftest import make_node


def test_policy_text_names_each_policy_set_and_nothing_else() -> None:
    assert qos_policy_text(None, {}) == {}
    cpus = parse_class_cpus("ls=1;be=0", frozenset({0, 1}))
    io = parse_class_io("be:wbps=10M,rbps=20M;ls:riops=2000")
    got = qos_policy_text(cpus, io, "7:0", PressurePolicy(), ("batch", "eval/x"))
    assert got == {"cpus.ls": "1", "cpus.be": "0",
                   "io.be": f"rbps={20 << 20},wbps={10 << 20}", "io.ls": "riops=2000",
                   "io.device": "7:0",
                   "pressure": "some_avg10>=10%,full_avg10>=2%,relieve=536870912,"
                               "max_per_round=8,min_idle_s=5",
                   "be_only": "batch,eval/x"}
    # only one class pinned: the other is absent (it runs on every CPU)
    assert qos_policy_text(parse_class_cpus("be=0", frozenset({0, 1})), {}) == {"cpus.be": "0"}


class _Pinned:
    """A backend reporting a policy (as ContainerBackend.qos_policy does)."""

    def __init__(self, inner: object) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def qos_policy(self) -> dict[str, str]:
        return {"cpus.be": "0"}


async def test_node_info_carries_the_policies() -> None:
    from dsec.edge.backends.simulated import SimulatedBackend
    from dsec.edge.clock import FakeClock

    clock = FakeClock()
    node = make_node(_Pinned(SimulatedBackend(clock=clock)), clock=clock,
                     qos_be_only=("batch",), memory_pressure=PressurePolicy())
    await node.start()
    try:
        info = EdgeHandlers(node).node_info(None)  # type: ignore[arg-type]
        assert isinstance(info, NodeInfo)
        assert info.qos_policy["cpus.be"] == "0"
        assert info.qos_policy["be_only"] == "batch"
        assert info.qos_policy["pressure"].startswith("some_avg10>=10%")
    finally:
        await node.close()
    plain = make_node()
    await plain.start()
    try:
        assert EdgeHandlers(plain).node_info(None).qos_policy == {}  # type: ignore[arg-type]
    finally:
        await plain.close()
