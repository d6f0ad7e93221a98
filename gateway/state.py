"""Everything a request handler needs, built once at start-up and reached through a typed app key."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from engines.client import EngineClient
from engines.manager import EngineManager
from gateway.dispatcher import Dispatcher
from gateway.metrics import GatewayMetrics
from gateway.registry import EngineRegistry
from laps.config import Config
from laps.tokenizer import ChatTokenizer
from policies.classifier import Classifier
from policies.prefix_index import PrefixIndex


@dataclass
class Gateway:
    """The gateway's long-lived parts: config, tokenizer, engines, classifier, dispatcher, prefix index, metrics.

    ``manager`` runs the engine processes; ``None`` when the gateway was given
    the URLs of engines that run on their own.
    """

    config: Config
    tokenizer: ChatTokenizer
    registry: EngineRegistry
    client: EngineClient
    classifier: Classifier
    dispatcher: Dispatcher
    prefix_index: PrefixIndex
    metrics: GatewayMetrics
    manager: EngineManager | None = None


GATEWAY = web.AppKey("gateway", Gateway)
