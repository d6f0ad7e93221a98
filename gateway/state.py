"""Everything a request handler needs, built once at start-up and reached through a typed app key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from engines.client import EngineClient
from engines.manager import EngineManager
from gateway.dispatcher import Dispatcher
from gateway.metrics import GatewayMetrics
from gateway.registry import EngineRegistry
from laps.chat_cache import ChatPrefixCache
from laps.config import Config
from laps.tokenizer import ChatTokenizer
from policies.classifier import Classifier
from policies.exact_prefix import PrefixCaches

if TYPE_CHECKING:
    from gateway.pd_dispatch import PDDispatch


@dataclass
class Gateway:
    """The gateway's long-lived parts: config, tokenizer, engines, classifier, dispatcher, prefix index, metrics.

    ``manager`` runs the engine processes; ``None`` when the gateway was given
    the URLs of engines that run on their own. ``pd``: the decode placement and
    bootstrap addresses of a prefill-decode deployment (``None``: no ``pd:``).
    """

    config: Config
    tokenizer: ChatTokenizer
    registry: EngineRegistry
    client: EngineClient
    classifier: Classifier
    dispatcher: Dispatcher
    prefix_index: PrefixCaches
    metrics: GatewayMetrics
    manager: EngineManager | None = None
    pd: "PDDispatch | None" = None
    prompt_cache: ChatPrefixCache | None = None  # built from ``tokenizer`` and the prefix block size when None


    def __post_init__(self) -> None:
        if self.prompt_cache is None:
            self.prompt_cache = ChatPrefixCache(self.tokenizer, self.prefix_index.block_tokens)


GATEWAY = web.AppKey("gateway", Gateway)
