"""Client and admin authentication: ``Authorization: Bearer KEY`` (the scheme's case does not matter).

Client keys (``gateway.api_keys``, see :mod:`laps.api_keys`) guard the ``/v1`` API when set; a refused request
gets OpenAI's 401 body (``invalid_request_error``, code ``invalid_api_key``) and ``WWW-Authenticate: Bearer``, and is
counted and logged as the gateway's other refusals (:func:`gateway.errors.note_refusal`).
Each accepted request is counted under its key's label (``laps_api_key_requests_total``).
"""

from __future__ import annotations

import hmac
import ipaddress

from aiohttp import web

from gateway.errors import UNPLACED, APIError, note_refusal
from gateway.state import GATEWAY, Gateway
from laps.api_keys import key_digest


def bearer_token(request: web.Request) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header (any case of ``Bearer``); ``None`` without one."""
    scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def admin_key_given(request: web.Request, gw: Gateway) -> bool:
    """Whether the request carries ``gateway.admin_key`` as its Bearer key (``False`` when no admin key is set)."""
    key, given = gw.config.gateway.admin_key, bearer_token(request)
    return key is not None and given is not None and hmac.compare_digest(given.encode(), key.encode())


def _refused(message: str, code: str | None) -> APIError:
    err = APIError(401, message, type="invalid_request_error", code=code)
    err.headers["WWW-Authenticate"] = "Bearer"
    return err


def _masked(key: str) -> str:
    return f"{key[:3]}...{key[-4:]}" if len(key) > 10 else "***"


@web.middleware
async def api_key_middleware(request: web.Request, handler):
    """Refuse ``/v1`` requests without a configured client key (when ``gateway.api_keys`` is set); count the rest."""
    gw = request.app.get(GATEWAY)
    if gw is None or gw.api_keys is None or not request.path.startswith("/v1/"):
        return await handler(request)
    given = bearer_token(request)
    label = None if given is None else gw.api_keys.get(key_digest(given))
    if label is None:
        err = _refused("You didn't provide an API key. Send it in an Authorization header using Bearer auth "
                       "(Authorization: Bearer YOUR_KEY).", None) if given is None else \
            _refused(f"Incorrect API key provided: {_masked(given)}.", "invalid_api_key")
        note_refusal(request, err, gw.metrics.of_class(UNPLACED).requests, 0.0)
        raise err
    gw.metrics.api_key_requests.labels(label).inc()
    return await handler(request)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
