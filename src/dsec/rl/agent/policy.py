"""An LLM policy behind any OpenAI-compatible endpoint (vLLM, SGLang, TGI, OpenAI...).

:class:`OpenAIPolicy` sends an episode's full chat history (system, user, assistant with
its tool calls, tool results) with the tool schemas to ``chat.completions`` through the
official ``openai`` package (its retries with backoff and its timeouts), and returns the
assistant :class:`~dsec.rl.agent.types.Message`, with the completion's token ids and
logprobs when the endpoint returns them (``logprobs=True``; ``return_token_ids`` for vLLM's
exact ids, sent as an extra body field that other servers ignore). At most
``max_concurrency`` requests are in flight per policy object, however many episodes run.

Tool calling is native (``tools=``, the reply's ``tool_calls``) or, for endpoints without
it, Hermes-style (``tool_format="hermes"``: the schemas in a system prompt, calls parsed from
``<tool_call>`` blocks of the text; see :mod:`dsec.rl.agent.tools`).

Errors map onto dsec's tree: an endpoint that stays unreachable or answers 5xx after the
retries is :class:`~dsec.errors.Unavailable` (infrastructure: the engine masks the
episode), a 4xx is :class:`~dsec.errors.InvalidArgument` naming the endpoint's message,
a request past ``timeout_s`` :class:`~dsec.errors.RequestTimeout`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import httpx
import msgspec

from dsec.errors import InvalidArgument, RemoteProtocolError, RequestTimeout, Unavailable
from dsec.rl.agent.tools import TOOL_NAMES, hermes_system_prompt, openai_tools
from dsec.rl.agent.types import LOGPROB_FLOOR, Message, ModelInfo, ToolCall

__all__ = ["OpenAIPolicy", "Policy", "PolicyConfig", "SamplingParams"]


class Policy(Protocol):
    """What the rollout engine asks of a policy: the next assistant message."""

    async def act(self, messages: Sequence[Message]) -> Message: ...

    def info(self) -> ModelInfo: ...

    @property
    def system_prompt(self) -> str | None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """Sampling parameters sent with every request (None: the endpoint's default)."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    extra_body: Mapping[str, Any] = field(default_factory=dict)   # e.g. {"top_k": 20}

    def as_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        for name in ("temperature", "top_p", "max_tokens", "seed"):
            v = getattr(self, name)
            if v is not None:
                kw[name] = v
        if self.stop:
            kw["stop"] = list(self.stop)
        return kw


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyConfig:
    """Where the model is and how to talk to it. Times in seconds."""

    base_url: str                          # e.g. "http://127.0.0.1:8000/v1"
    model: str
    api_key: str = "EMPTY"                 # local servers ignore it; the package needs one
    sampling: SamplingParams = field(default_factory=SamplingParams)
    timeout_s: float = 120.0               # one request, retries excluded
    max_retries: int = 2                   # the openai package's (connection errors, 408,
                                           # 409, 429, 5xx), with exponential backoff
    max_concurrency: int = 64              # requests in flight from this policy
    connections_per_client: int = 32       # HTTP connections per pool (see OpenAIPolicy)
    logprobs: bool = True                  # ask for per-token logprobs
    return_token_ids: bool = True          # vLLM extra: the exact completion/prompt ids
    tool_format: Literal["openai", "hermes"] = "openai"
    tools: tuple[str, ...] = TOOL_NAMES
    system_prompt: str | None = None       # prepended to every episode (hermes: + schemas)

    def __post_init__(self) -> None:
        if not re.match(r"^https?://", self.base_url):
            raise InvalidArgument(f"base_url {self.base_url!r} must be an http(s) URL",
                                  field="base_url")
        if self.max_concurrency < 1:
            raise InvalidArgument(f"max_concurrency={self.max_concurrency} must be >= 1")
        if self.connections_per_client < 1:
            raise InvalidArgument(f"connections_per_client={self.connections_per_client} "
                                  "must be >= 1")
        if not self.timeout_s > 0:
            raise InvalidArgument(f"timeout_s={self.timeout_s} must be > 0")
        if self.max_retries < 0:
            raise InvalidArgument(f"max_retries={self.max_retries} must be >= 0")


_TOKEN_ID = re.compile(r"^token_id:(\d+)$")


# The parts of a chat completion this client keeps (unknown fields are ignored).
class _Function(msgspec.Struct):
    name: str
    arguments: str | None = None


class _ToolCall(msgspec.Struct):
    id: str | None = None
    function: _Function | None = None


class _Reply(msgspec.Struct):
    content: str | None = None
    tool_calls: list[_ToolCall] | None = None


class _TokenLogprob(msgspec.Struct):
    logprob: float
    token: str = ""


class _Logprobs(msgspec.Struct):
    content: list[_TokenLogprob] | None = None


class _Choice(msgspec.Struct):
    message: _Reply
    finish_reason: str | None = None
    logprobs: _Logprobs | None = None
    token_ids: list[int] | None = None          # vLLM's return_token_ids


class _Completion(msgspec.Struct):
    choices: list[_Choice]
    prompt_token_ids: list[int] | None = None   # vLLM's return_token_ids


_completion_decoder = msgspec.json.Decoder(_Completion)


class OpenAIPolicy:
    """A :class:`Policy` over an OpenAI-compatible endpoint (see the module docstring).
    Create it inside the event loop that runs the episodes (the HTTP pool is bound to it);
    ``await policy.close()`` at the end."""

    def __init__(self, config: PolicyConfig) -> None:
        try:
            import openai
        except ImportError as exc:  # pragma: no cover - the rl extra installs it
            raise InvalidArgument("OpenAIPolicy needs the openai package: "
                                  "pip install 'dsec[rl]'") from exc
        self.config = config
        self._openai = openai
        # Several small HTTP pools, not one big one: httpcore's pool scans every connection
        # on every request (has_expired -> a socket poll each), so 200 requests in flight
        # through one pool of 200 connections took 3.3-6.3 s against the scripted endpoint
        # (py-spy: 17% in has_expired) on this 2-core VM; 32 per pool keeps the scan short.
        n_pools = -(-config.max_concurrency // config.connections_per_client)
        per = min(config.max_concurrency, config.connections_per_client)
        self._clients = [openai.AsyncOpenAI(
            base_url=config.base_url, api_key=config.api_key, timeout=config.timeout_s,
            max_retries=config.max_retries,
            http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(
                max_connections=per, max_keepalive_connections=per)))
            for _ in range(n_pools)]
        self._next = 0
        self._sem = asyncio.Semaphore(config.max_concurrency)
        self._tools = openai_tools(config.tools) if config.tool_format == "openai" else None
        sys = config.system_prompt
        if config.tool_format == "hermes":
            sys = ((sys + "\n\n") if sys else "") + hermes_system_prompt(config.tools)
        self._system = sys
        self.requests = 0

    @property
    def system_prompt(self) -> str | None:
        return self._system

    def info(self) -> ModelInfo:
        s = self.config.sampling
        return ModelInfo(model=self.config.model, base_url=self.config.base_url,
                         sampling={**s.as_kwargs(), **dict(s.extra_body),
                                   "tool_format": self.config.tool_format})

    async def act(self, messages: Sequence[Message]) -> Message:
        cfg = self.config
        kw = cfg.sampling.as_kwargs()
        extra = dict(cfg.sampling.extra_body)
        if cfg.return_token_ids:
            extra.setdefault("return_token_ids", True)
        if cfg.logprobs:
            kw["logprobs"] = True
        if self._tools is not None:
            kw["tools"] = self._tools
        oa = self._openai
        async with self._sem:
            self.requests += 1
            try:
                client = self._clients[self._next % len(self._clients)]
                self._next += 1
                # client.post (the package's documented door for raw requests) with a
                # plain JSON body: create() first walks the whole history through its
                # TypedDict transform. Measured with an 18-message history, 20 in flight:
                # 5.8-7.7 ms of trainer CPU per request via create() vs 1.75 ms here
                # (py-spy had the transform at 10% of the trainer with 200 episodes);
                # retries, timeouts and errors are the same. The reply is decoded with
                # msgspec into the fields we keep, not into the package's pydantic models.
                body = {"model": cfg.model, "messages": [m.to_openai() for m in messages],
                        **kw, **extra}
                rep = await client.post("/chat/completions", body=body,
                                        cast_to=httpx.Response)
                raw = await rep.aread()
            except httpx.TimeoutException as exc:     # reading the body, after openai
                raise RequestTimeout(f"model endpoint {cfg.base_url} stalled sending its "
                                     f"reply (timeout {cfg.timeout_s}s)") from exc
            except httpx.HTTPError as exc:
                raise Unavailable(f"model endpoint {cfg.base_url} broke off its reply: "
                                  f"{exc}") from exc
            except oa.APITimeoutError as exc:
                raise RequestTimeout(f"model endpoint {cfg.base_url} did not answer within "
                                     f"{cfg.timeout_s}s (after {cfg.max_retries} retries); "
                                     "raise PolicyConfig.timeout_s") from exc
            except oa.APIConnectionError as exc:
                raise Unavailable(f"model endpoint {cfg.base_url} unreachable after "
                                  f"{cfg.max_retries} retries: {exc}") from exc
            except oa.APIStatusError as exc:
                if exc.status_code >= 500 or exc.status_code == 429:
                    raise Unavailable(f"model endpoint {cfg.base_url} answered "
                                      f"{exc.status_code} after {cfg.max_retries} retries: "
                                      f"{exc.message}") from exc
                raise InvalidArgument(f"model endpoint {cfg.base_url} refused the request "
                                      f"({exc.status_code}): {exc.message}") from exc
        return self._message(raw)

    def _message(self, raw: bytes) -> Message:
        try:
            rep = _completion_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise RemoteProtocolError(f"model endpoint {self.config.base_url} answered with "
                                      f"an invalid chat completion: {exc}") from exc
        if not rep.choices:
            raise RemoteProtocolError(f"model endpoint {self.config.base_url} answered "
                                      "without choices")
        ch = rep.choices[0]
        msg = ch.message
        calls = tuple(ToolCall(id=tc.id or f"call_{i}", name=tc.function.name,
                               arguments=tc.function.arguments or "")
                      for i, tc in enumerate(msg.tool_calls or ()) if tc.function is not None)
        logprobs: list[float] | None = None
        ids: list[int] | None = None
        content_lp = ch.logprobs.content if ch.logprobs is not None else None
        if content_lp:
            logprobs = [max(LOGPROB_FLOOR, t.logprob) for t in content_lp]
            spelled = [_TOKEN_ID.match(t.token) for t in content_lp]
            if all(spelled):
                ids = [int(m.group(1)) for m in spelled if m]
        if ch.token_ids is not None:
            ids = ch.token_ids
        return Message(role="assistant", content=msg.content, tool_calls=calls,
                       token_ids=ids, logprobs=logprobs, prompt_token_ids=rep.prompt_token_ids,
                       finish_reason=ch.finish_reason)

    async def close(self) -> None:
        for c in self._clients:
            await c.close()
