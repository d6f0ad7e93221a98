"""``POST /pd_role_switch``: flip an idle PD engine between prefill and decode at runtime, as SGLang 0.5.23 does.

SGLang 0.5.23 (``entrypoints/http_server.py`` route ``/pd_role_switch``,
``managers/tokenizer_control_mixin.py`` ``pd_role_switch``,
``disaggregation/role_switch.py`` ``handle_pd_role_switch``, body and answer in
``managers/io_struct.py`` ``PdRoleSwitchReqInput`` / ``PdRoleSwitchReqOutput``):

* Body: ``new_role`` (``"prefill"``, ``"decode"``; ``""``, the default, is
  refused as invalid), ``decode_cuda_graph_bs`` (list of ints or null: the
  decode batch sizes to capture on a flip to decode), ``decode_cuda_graph_memory_gb``
  (number or null: the decode graphs' footprint, measured on a decode peer),
  ``prepare_only`` (bool: check only, change nothing). Unknown keys are ignored;
  a field of the wrong type fails FastAPI's body validation (422, ``detail``).
* Answer: ``{"rid": null, "http_worker_ipc": null, "success", "message",
  "old_role", "new_role", "safe_to_restore"}``, 200 when ``success``, else 400.
  ``safe_to_restore``: the instance may be routed to again in its old role.
* Refusals, first match wins: ``--enable-pd-role-switch is not set on this
  server``; ``invalid new_role='…'``; ``instance is not running in PD
  disaggregation mode``; ``transfer backend '…' does not support runtime role
  switch`` (only mooncake, its ``mooncake_tcp`` alias, ascend, whose manager
  derives from mooncake's, and mori do). Then the same role answers success
  ``already in target role`` even while busy; a busy instance (anything
  waiting, running, bootstrapping or transferring: ``Scheduler.is_fully_idle``)
  ``instance is not idle; drain all requests before switching``. A flip to
  decode of an instance without captured decode CUDA graphs (one launched as
  prefill: SGLang disables a prefill server's decode graphs unless
  ``--cuda-graph-backend-decode`` is given) needs ``decode_cuda_graph_memory_gb``
  (``… is required before capturing decode graphs``; ``… must be
  non-negative``; ``insufficient decode CUDA graph headroom: required=X GB,
  available=Y GB``). ``prepare_only`` then answers ``ready``.
* The flip: the role's disaggregation queues and KV manager are torn down and
  rebuilt, the radix cache, request slots and KV pool are reset (their
  prefixes would be stale in the new role), decode graphs are captured on a
  first flip to decode, and the answer is ``ok``. The token KV pool itself is
  not reallocated; no process restarts. With the flag every PD instance runs a
  KV bootstrap server (a decode one too), so a flipped one has it.

The simulated engine answers the same, with its own idle test (nothing in its
core, no room open, no KV hand-off in flight) and its own free memory
(GPU memory × (1 − ``mem_fraction_static``), what SGLang's static pool
leaves). Not modelled: what the launch role fixes for good in SGLang (a
decode launch disables the radix cache unless
``--disaggregation-decode-enable-radix-cache``, and the prefill CUDA graphs;
neither comes back on a flip to prefill), and capture-to-fit batch sizes
(``decode_cuda_graph_bs`` is checked, the latency keeps the launch's graphs).
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from engines.sim.latency import GPUS
from engines.sim.protocol import json_response, read_body
from engines.sim.realtime import ENGINE, SimEngine

log = logging.getLogger("engines.sim")

ROLE_SWITCH_BACKENDS = frozenset({"mooncake", "mooncake_tcp", "ascend", "mori"})
"""Transfer backends whose KV manager supports a runtime role switch in SGLang 0.5.23 (``supports_role_switch``)."""
GIB = 1 << 30
_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "new_role": ((str,), "string"), "decode_cuda_graph_bs": ((list,), "list"),
    "decode_cuda_graph_memory_gb": ((int, float), "number"), "prepare_only": ((bool,), "bool"),
}


class RoleSwitchState:
    """Whether the engine has decode CUDA graphs (captured at launch or on a first flip to decode)."""

    def __init__(self, engine: SimEngine) -> None:
        args = engine.sim.args
        self.decode_graphs_captured = engine.sim.decode_graph.backend != "disabled" and (
            args.disaggregation_mode == "decode" or args.cuda_graph_backend_decode is not None)


ROLE_SWITCH = web.AppKey("role_switch", RoleSwitchState)


def _validation_error(body: dict[str, Any]) -> web.Response | None:
    """FastAPI's 422 for a body field of the wrong type, or None when the body is valid."""
    for name, (kinds, kind_name) in _FIELDS.items():
        value = body.get(name)
        bad = value is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds))
        if name == "new_role" and isinstance(value, str) and value not in ("prefill", "decode", ""):
            bad = True
        if name == "decode_cuda_graph_bs" and isinstance(value, list):
            bad = bad or not all(isinstance(b, int) and not isinstance(b, bool) for b in value)
        if bad:
            msg = "Input should be 'prefill', 'decode' or ''" if name == "new_role" else f"Input should be a valid {kind_name}"
            return json_response({"detail": [{"type": "value_error", "loc": ["body", name], "msg": msg, "input": value}]}, 422)
    return None


def _busy(engine: SimEngine) -> bool:
    """True while anything is waiting, running, bootstrapping or transferring (SGLang's ``is_fully_idle`` negated)."""
    pd = engine.pd
    return not engine.core.fully_idle() or (pd is not None and pd.busy())


async def pd_role_switch(request: web.Request) -> web.Response:
    """``POST /pd_role_switch``: flip this idle PD engine to ``new_role`` (see the module docstring)."""
    engine, state = request.app[ENGINE], request.app[ROLE_SWITCH]
    body = await read_body(request, openai=False)
    invalid = _validation_error(body)
    if invalid is not None:
        return invalid
    args = engine.sim.args
    old_role, new_role = engine.core.config.disaggregation_mode, body.get("new_role") or ""

    def answer(success: bool, message: str, safe_to_restore: bool = False) -> web.Response:
        if not success:
            log.warning("PD role switch rejected (%s -> %s): %s", old_role, new_role, message)
        return json_response({"rid": None, "http_worker_ipc": None, "success": success, "message": message,
                              "old_role": old_role, "new_role": new_role, "safe_to_restore": safe_to_restore},
                             200 if success else 400)

    if not args.enable_pd_role_switch:
        return answer(False, "--enable-pd-role-switch is not set on this server", True)
    if new_role not in ("prefill", "decode"):
        return answer(False, f"invalid new_role={new_role!r}", True)
    if old_role == "null":
        return answer(False, "instance is not running in PD disaggregation mode", True)
    if args.disaggregation_transfer_backend not in ROLE_SWITCH_BACKENDS:
        return answer(False, f"transfer backend {args.disaggregation_transfer_backend!r} does not support runtime role switch", True)
    if new_role == old_role:
        return answer(True, "already in target role")
    if _busy(engine):
        return answer(False, "instance is not idle; drain all requests before switching", True)
    required_gb = body.get("decode_cuda_graph_memory_gb")
    if new_role == "decode" and not state.decode_graphs_captured:
        if required_gb is None:
            return answer(False, "decode_cuda_graph_memory_gb is required before capturing decode graphs", True)
        if required_gb < 0:
            return answer(False, "decode_cuda_graph_memory_gb must be non-negative", True)
        available_gb = GPUS[args.sim_gpu].memory_bytes * (1 - engine.sim.mem_fraction_static) / GIB
        if available_gb < required_gb:
            return answer(False, f"insufficient decode CUDA graph headroom: required={required_gb:.3f} GB, "
                                 f"available={available_gb:.3f} GB", True)
    if body.get("prepare_only"):
        return answer(True, "ready", True)
    engine.core.switch_disaggregation_mode(new_role)
    engine.publish_kv_events()  # the emptied prefix cache's clear, at once as after /flush_cache
    engine.pd.mode = new_role
    if new_role == "decode":
        state.decode_graphs_captured = True
    log.info("PD role switch succeeded: %s -> %s", old_role, new_role)
    return answer(True, "ok")


def add_role_switch_route(app: web.Application) -> None:
    """Register ``POST /pd_role_switch`` on the engine's ``app`` (its :data:`ENGINE` must be set)."""
    app[ROLE_SWITCH] = RoleSwitchState(app[ENGINE])
    app.router.add_post("/pd_role_switch", pd_role_switch)
