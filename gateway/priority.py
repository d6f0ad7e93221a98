"""Request priority: SGLang's ``priority`` field or the ``x-laps-priority`` header, for the queues and the engines.

SGLang 0.5.23 started with ``--enable-priority-scheduling`` orders its waiting
queue by a request's integer ``priority``, higher values first, or lower first
with ``--schedule-low-priority-values-first``; requests without one go last
(``Scheduler._set_or_validate_priority`` and ``SchedulePolicy._sort_by_priority_and_fcfs``
in ``sglang/srt/managers``). Without the flag it ignores the field, or, with
``--abort-on-priority-when-disabled``, refuses the request.

The gateway takes the priority from the body's ``priority`` (checked by the
request schema) or from the ``x-laps-priority`` header (which wins when both
are set), orders its queues of a class by it in the engines' direction
(:attr:`policies.types.RequestView.priority`: higher first, so the value is
negated when the engines' roles schedule low values first) and sends it on
only to an engine whose current role has ``enable-priority-scheduling`` among
its flags; the others get the body without it.
"""

from __future__ import annotations

import re

from aiohttp import web

from gateway.errors import APIError, single_header
from gateway.state import Gateway
from laps.config import Config

PRIORITY_HEADER = "x-laps-priority"
ENABLE_FLAG = "enable-priority-scheduling"
LOW_FIRST_FLAG = "schedule-low-priority-values-first"
_INT64 = (-(1 << 63), 1 << 63)
_INTEGER = re.compile(r"-?[0-9]+")  # not int()'s wider reading: "+5", "1_000", other scripts' digits


def request_priority(request: web.Request, body: dict) -> int | None:
    """The request's SGLang priority: the ``x-laps-priority`` header, else the body's ``priority`` (None: neither).

    Raises:
        APIError: 400 when the header is not a signed 64-bit integer in ASCII decimal digits, or is sent twice.
    """
    value = single_header(request, PRIORITY_HEADER)
    if value is None:
        return body.get("priority")
    priority = int(value) if _INTEGER.fullmatch(value) else None
    if priority is None or not _INT64[0] <= priority < _INT64[1]:
        raise APIError(400, f"header {PRIORITY_HEADER}: expected a signed 64-bit integer, got {value!r}", param=PRIORITY_HEADER)
    return priority


def low_values_first(config: Config) -> bool:
    """Whether the engines schedule low priority values first: some role enables priority scheduling that way."""
    return any(role.flags.get(ENABLE_FLAG) and role.flags.get(LOW_FIRST_FLAG) for role in config.roles.values())


def queue_priority(priority: int, low_first: bool) -> int:
    """SGLang's ``priority`` as :attr:`~policies.types.RequestView.priority` (higher first), and back (its own inverse)."""
    return -priority if low_first else priority


def view_priority(request: web.Request, body: dict, config: Config) -> int | None:
    """The request's :attr:`~policies.types.RequestView.priority` (None: it has none).

    Raises:
        APIError: as :func:`request_priority`.
    """
    priority = request_priority(request, body)
    return None if priority is None else queue_priority(priority, low_values_first(config))


def engine_role(gw: Gateway, engine_id: str) -> str:
    """The role ``engine_id`` runs now: its process's (the controller may have moved it), in a gateway worker the
    scheduler's as of its last state poll, else its configured one."""
    if gw.engine_roles is not None:
        return gw.engine_roles[engine_id]
    if gw.manager is not None and engine_id in gw.manager.engines:
        return gw.manager.engines[engine_id].role
    return next(e.role for e in gw.config.engines if e.name == engine_id)


def set_engine_priority(gw: Gateway, engine_id: str, body: dict, queued: int | None) -> None:
    """Put the SGLang priority of a request queued at ``queued`` (:func:`view_priority`) into the engine ``body``
    when ``engine_id`` schedules by priority; else leave the field out."""
    if queued is not None and gw.config.roles[engine_role(gw, engine_id)].flags.get(ENABLE_FLAG):
        body["priority"] = queue_priority(queued, low_values_first(gw.config))
    else:
        body.pop("priority", None)
