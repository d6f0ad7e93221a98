"""Everything a request handler needs, built once at start-up and reached through a typed app key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Callable

from aiohttp import web

from engines.client import EngineClient
from engines.manager import EngineManager
from gateway.dispatcher import Dispatcher
from gateway.metrics import GatewayMetrics
from gateway.pd_setup import DecodeSide
from gateway.registry import EngineRegistry, EngineState
from gateway.sched_worker import RemoteDispatcher, RemotePrefixIndex
from laps.chat_cache import ChatPrefixCache, EncodePool
from laps.config import Config
from laps.tokenizer import ChatTokenizer
from policies.exact_prefix import PrefixCaches

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

    from gateway.guard import RequestGuard


@dataclass
class Gateway:
    """The gateway's long-lived parts: config, tokenizer, engines, dispatcher (it classifies too), prefix index, metrics.

    ``manager`` runs the engine processes; ``None`` when the gateway was given
    the URLs of engines that run on their own. ``pd``: the decode side of a
    prefill-decode deployment, its placement and bootstrap addresses (``None``: no ``pd:``).
    ``tracer``: the request spans' tracer (``None``: tracing off).
    ``api_keys``: the client keys' ``{SHA-256 digest: label}`` (``None``: no client key needed).
    ``context_tokens``: the model's context length (tokens) as the engines list it (``None``: unknown, not checked).
    ``guards``: the cut-offs of the requests in flight (:mod:`gateway.guard`); ``closing``: the gateway is
    shutting down and takes no new request.
    In a gateway worker (``gateway.workers`` > 1) ``dispatcher`` and ``prefix_index`` are the scheduler
    process's, reached over the channel (:mod:`gateway.sched_worker`), ``registry`` mirrors its registry, and
    ``report_out_of_service(engine, why, stalled)`` tells it an engine this worker saw fail, and
    ``admin(message)`` sends it the admin API's calls (:mod:`gateway.admin`), and ``engine_roles`` mirrors the
    role each engine runs now (``None`` both, in one process: the engine manager knows).
    """

    config: Config
    tokenizer: ChatTokenizer
    registry: EngineRegistry
    client: EngineClient
    dispatcher: Dispatcher | RemoteDispatcher
    prefix_index: PrefixCaches | RemotePrefixIndex
    metrics: GatewayMetrics
    manager: EngineManager | None = None
    pd: DecodeSide | None = None
    prompt_cache: ChatPrefixCache | None = None  # built from ``tokenizer``, the prefix block size and the budget when None
    tracer: "Tracer | None" = None  # with tracing: on, gateway/tracing.py's spans
    api_keys: dict[str, str] | None = None
    context_tokens: int | None = None
    guards: "set[RequestGuard]" = field(default_factory=set)
    closing: bool = False
    report_out_of_service: Callable[[EngineState, str, bool], None] | None = None
    admin: Callable[[dict], Awaitable[dict]] | None = None
    engine_roles: dict[str, str] | None = None
    encoder: EncodePool = field(init=False)  # where ``prompt_cache`` tokenizes, by size; closed by the app's clean-up

    def __post_init__(self) -> None:
        if self.prompt_cache is None:
            self.prompt_cache = ChatPrefixCache(self.tokenizer, self.prefix_index.block_tokens, self.config.scheduling.chat_cache_bytes)
        self.encoder = EncodePool(self.prompt_cache, self.config.model.path, self.config.gateway.tokenizer_processes,
                                  self.config.gateway.tokenizer_process_min_chars)


GATEWAY = web.AppKey("gateway", Gateway)
