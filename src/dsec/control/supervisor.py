"""When to restart a crashed child process and when to give up: the pure half of
``dsec up``'s edge supervision (the process half is :mod:`dsec.cluster.edge_process`).

One :class:`Supervision` per child. Feed it events (``Start``, ``Ready``, ``Exited``,
``Stop``, ``Tick``) stamped with the time; it returns instructions (``Spawn``,
``Signal``, ``WakeAt``, ``Report``) for the runner to carry out. The lifecycle is a table
(:data:`TRANSITIONS`); an event the table does not allow raises
:class:`~dsec.errors.InvalidTransition` naming the child, the event and the state.

Policy (:class:`RestartPolicy`): a child that exits without being asked to is restarted
after a delay that starts small (well inside the control plane's node-loss TTL, so one
crash never costs a node its sandboxes) and doubles with each further crash, back to the
first delay after a run of ``stable_after_s``. A child that never became ready is not
restarted at all (a first start that fails is a configuration problem). ``crash_loop_crashes`` crashes within
``crash_loop_window_s`` is a crash loop: the child is left ``failed`` and a report says
why, instead of burning the machine restarting something that cannot start. A child
that does not report ready within ``start_timeout_s`` is killed, which counts as a crash.
"""

from __future__ import annotations

import signal
from collections import deque
from dataclasses import dataclass
from typing import Literal

from dsec.errors import InvalidArgument, InvalidTransition

__all__ = ["TRANSITIONS", "ChildState", "ExitStatus", "Exited", "Instruction", "Ready",
           "Report", "RestartPolicy", "Signal", "Spawn", "Start", "Stop", "Supervision",
           "Tick", "WakeAt"]

ChildState = Literal["idle", "starting", "running", "backoff", "failed", "stopping", "stopped"]

#: state -> event -> next state. ``exit`` of a running child goes to ``backoff``; the
#: policy may then move it on with ``give_up`` (crash loop) or ``restart`` (delay over).
TRANSITIONS: dict[ChildState, dict[str, ChildState]] = {
    "idle":     {"start": "starting", "stop": "stopped"},
    "starting": {"ready": "running", "exit": "backoff", "stop": "stopping"},
    "running":  {"exit": "backoff", "stop": "stopping"},
    "backoff":  {"restart": "starting", "give_up": "failed", "start": "starting",
                 "stop": "stopped"},
    "failed":   {"start": "starting", "stop": "stopped"},
    "stopping": {"exit": "stopped"},
    "stopped":  {"start": "starting", "stop": "stopped"},
}


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartPolicy:
    """Units are in the names. The defaults keep a crashed edge's downtime (first delay
    + ~0.3 s to start a Python process and re-adopt) far below the default node-loss TTL
    of 10 s; a crash loop is declared after 5 crashes within a minute."""

    first_delay_s: float = 0.1          # restart after a first crash this soon
    max_delay_s: float = 5.0            # backoff ceiling
    factor: float = 2.0                 # each consecutive crash multiplies the delay
    stable_after_s: float = 30.0        # a run this long forgets earlier crashes' backoff
    crash_loop_crashes: int = 5         # this many crashes ...
    crash_loop_window_s: float = 60.0   # ... within this window: give up
    start_timeout_s: float = 60.0       # not ready by then: killed, counted as a crash
    stop_grace_s: float = 30.0          # after SIGTERM, SIGKILL once this has passed

    def __post_init__(self) -> None:
        for name in ("first_delay_s", "max_delay_s", "stable_after_s", "crash_loop_window_s",
                     "start_timeout_s", "stop_grace_s"):
            if not getattr(self, name) >= 0:
                raise InvalidArgument(f"restart policy {name} must be >= 0 seconds")
        if self.factor < 1 or self.crash_loop_crashes < 1:
            raise InvalidArgument("restart policy factor must be >= 1 and "
                                  "crash_loop_crashes >= 1")

    def delay(self, consecutive: int) -> float:
        """Delay before the restart after the ``consecutive``-th crash in a row (1-based)."""
        return min(self.max_delay_s, self.first_delay_s * self.factor ** (consecutive - 1))


@dataclass(frozen=True, slots=True)
class ExitStatus:
    """How a process ended: ``code`` (it exited) or ``signal`` (it was killed)."""

    code: int | None = None
    signal: int | None = None

    @classmethod
    def from_returncode(cls, rc: int) -> ExitStatus:
        """``subprocess`` style: negative = killed by that signal."""
        return cls(signal=-rc) if rc < 0 else cls(code=rc)

    def __str__(self) -> str:
        if self.signal is not None:
            try:
                return f"killed by {signal.Signals(self.signal).name}"
            except ValueError:
                return f"killed by signal {self.signal}"
        return f"exit code {self.code}"


# ----------------------------------------------------------------------- events
@dataclass(frozen=True, slots=True)
class Start:
    now: float


@dataclass(frozen=True, slots=True)
class Ready:
    now: float


@dataclass(frozen=True, slots=True)
class Exited:
    now: float
    status: ExitStatus


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop the child: SIGTERM with ``grace_s`` before SIGKILL (``grace_s=0`` kills at
    once, as a machine dying would)."""

    now: float
    grace_s: float | None = None   # None = the policy's stop_grace_s


@dataclass(frozen=True, slots=True)
class Tick:
    now: float


Event = Start | Ready | Exited | Stop | Tick


# ------------------------------------------------------------------ instructions
@dataclass(frozen=True, slots=True)
class Spawn:
    """Start the child process (the runner feeds ``Ready``/``Exited`` back)."""


@dataclass(frozen=True, slots=True)
class Signal:
    signum: int


@dataclass(frozen=True, slots=True)
class WakeAt:
    """Feed a ``Tick`` no later than ``at``."""

    at: float


@dataclass(frozen=True, slots=True)
class Report:
    level: Literal["info", "warning", "error"]
    message: str


Instruction = Spawn | Signal | WakeAt | Report


class Supervision:
    """The state of one supervised child; see the module docstring."""

    def __init__(self, name: str, policy: RestartPolicy | None = None) -> None:
        self.name = name
        self.policy = policy or RestartPolicy()
        self.state: ChildState = "idle"
        self.crashes: deque[float] = deque()   # crash times within the window
        self.consecutive = 0                  # crashes since the last stable run
        self.restarts = 0                     # restarts done (for status lines)
        self.last_exit: ExitStatus | None = None
        self.started_at = 0.0
        self.ever_ready = False               # it served at least once
        self._deadline: float | None = None   # start timeout / stop grace / restart time
        self._killed_for_timeout = False

    def _go(self, event: str) -> None:
        nxt = TRANSITIONS[self.state].get(event)
        if nxt is None:
            allowed = ", ".join(sorted(TRANSITIONS[self.state])) or "nothing"
            raise InvalidTransition(
                f"child {self.name} cannot {event} while it is {self.state}; allowed: "
                f"{allowed}", child=self.name, event=event, state=self.state)
        self.state = nxt

    @property
    def deadline(self) -> float | None:
        """When the next ``Tick`` is due (None: nothing timed is pending)."""
        return self._deadline

    def handle(self, event: Event) -> list[Instruction]:
        if isinstance(event, Start):
            return self._start(event.now)
        if isinstance(event, Ready):
            if self.state != "starting":
                return []   # a late readiness note after a stop: nothing to do
            self._go("ready")
            self.ever_ready = True
            self._deadline = None
            return [Report("info", f"{self.name} is ready")] if self.restarts else []
        if isinstance(event, Exited):
            return self._exited(event.now, event.status)
        if isinstance(event, Stop):
            return self._stop(event.now, event.grace_s)
        return self._tick(event.now)

    def _start(self, now: float) -> list[Instruction]:
        if self.state in ("starting", "running", "stopping"):
            return []   # already on its way
        if self.state == "failed":
            self.crashes.clear()   # started again by hand: a fresh crash budget
            self.consecutive = 0
        self._go("start")
        self.started_at = now
        self._killed_for_timeout = False
        self._deadline = now + self.policy.start_timeout_s
        return [Spawn(), WakeAt(self._deadline)]

    def _exited(self, now: float, status: ExitStatus) -> list[Instruction]:
        self.last_exit = status
        if self.state == "stopping":
            self._go("exit")
            self._deadline = None
            return [Report("info", f"{self.name} stopped ({status})")]
        was = self.state
        self._go("exit")
        p = self.policy
        ran = now - self.started_at
        if was == "running" and ran >= p.stable_after_s:
            self.consecutive = 0
        self.consecutive += 1
        self.crashes.append(now)
        while self.crashes and self.crashes[0] < now - p.crash_loop_window_s:
            self.crashes.popleft()
        why = ("did not become ready within "
               f"{p.start_timeout_s:g}s" if self._killed_for_timeout else str(status))
        if not self.ever_ready:
            # It never served: a first start that fails is a configuration problem
            # (bad flags, a locked state dir), which restarting would only repeat.
            self._go("give_up")
            self._deadline = None
            return [Report("error", f"{self.name} failed to start ({why}) and never served; "
                                    "not restarting it: fix the cause and start it again")]
        if len(self.crashes) >= p.crash_loop_crashes:
            self._go("give_up")
            self._deadline = None
            return [Report("error",
                           f"{self.name} crashed {len(self.crashes)} times within "
                           f"{p.crash_loop_window_s:g}s (last: {why}); not restarting it "
                           "(a crash loop): its sandboxes stay on the host and in its "
                           "journal, and are re-adopted when it runs again")]
        delay = p.delay(self.consecutive)
        self._deadline = now + delay
        return [Report("warning",
                       f"{self.name} {'crashed' if was == 'running' else 'failed to start'} "
                       f"({why}) after {ran:.1f}s; restarting in {delay:g}s "
                       f"(crash {len(self.crashes)} of {p.crash_loop_crashes} allowed within "
                       f"{p.crash_loop_window_s:g}s)"),
                WakeAt(self._deadline)]

    def _stop(self, now: float, grace_s: float | None) -> list[Instruction]:
        if self.state in ("stopping", "stopped"):
            if self.state == "stopping" and grace_s == 0:
                return [Signal(signal.SIGKILL)]
            return []
        live = self.state in ("starting", "running")
        self._go("stop")
        if not live:
            self._deadline = None
            return []
        grace = self.policy.stop_grace_s if grace_s is None else grace_s
        if grace <= 0:
            self._deadline = None
            return [Signal(signal.SIGKILL)]
        self._deadline = now + grace
        return [Signal(signal.SIGTERM), WakeAt(self._deadline)]

    def _tick(self, now: float) -> list[Instruction]:
        if self._deadline is None or now < self._deadline:
            return [] if self._deadline is None else [WakeAt(self._deadline)]
        self._deadline = None
        if self.state == "backoff":
            self._go("restart")
            self.restarts += 1
            self.started_at = now
            self._killed_for_timeout = False
            self._deadline = now + self.policy.start_timeout_s
            return [Spawn(), WakeAt(self._deadline)]
        if self.state == "starting":
            self._killed_for_timeout = True
            return [Report("warning", f"{self.name} did not become ready within "
                                      f"{self.policy.start_timeout_s:g}s; killing it"),
                    Signal(signal.SIGKILL)]
        if self.state == "stopping":
            return [Report("warning", f"{self.name} did not stop within its grace period; "
                                      "killing it"),
                    Signal(signal.SIGKILL)]
        return []
