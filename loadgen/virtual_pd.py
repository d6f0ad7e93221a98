"""Virtual-time simulation of a prefill–decode (PD) disaggregated deployment (DESIGN §2, §5; issue 9).

A :class:`VirtualPDRun` is a :class:`~loadgen.virtual.VirtualRun` whose
engines split into prefill engines (roles of pool ``short`` or ``long``, started
with ``--disaggregation-mode prefill``) and decode engines (pool ``decode``,
``--disaggregation-mode decode``); the deployment's ``pd:`` section names the
KV link. One request goes through:

1. **Prefill placement**: the scheduler (``scheduling.policy``, unchanged) sees
   only the prefill engines (:meth:`EngineRegistry.views`), so LAPS's AWD
   windows and short/long pools, and the router baselines, pick among them
   exactly as without PD. The pressure controller (``controller:``) sees the
   same views and moves engines between the two prefill pools; with
   ``pd.role_switch`` it also sees the decode engines and sizes the decode
   pool (:class:`~policies.pd_controller.PDPressureController`), and a move
   between the sides is a flip in place (:class:`~loadgen.virtual.VirtualRun`)
   or, where the roles' flags differ, a restart.
2. **Decode placement**, at the same moment (the gateway sends the request to
   both engines at once, as SGLang's PD protocol wants):
   :func:`policies.registry.make_decode_placement` over the decode
   engines (:meth:`EngineRegistry.decode_views`), with the prompt length as the
   context; the request counts as in flight on both engines.
3. The prefill engine prefills it and samples the first token (SGLang's
   prefill server does); the scheduler hears ``on_first_token`` from the
   prefill engine then, and the KV transfer starts on a shared
   :class:`~engines.sim.kv_transfer.KvTransferNetwork` (bytes: prompt tokens ×
   the model's KV bytes per token / the prefill engine's TP size, one link per
   rank, as the live simulated engine prices it; bandwidth: ``pd`` link; an AWD batch's
   requests leave their prefill engine together and share its port).
4. When the transfer ends the prefill engine unpins the KV (the prompt stays in
   its prefix cache; the gateway's prefix index learns the prompt, not the
   reply, which only the decode engine ever holds), the scheduler hears
   ``on_complete`` for the prefill engine, and the decode engine receives the
   request (:meth:`EngineCore.add_transferred_request`). For the controller,
   the request's first token counts for its prefill engine now (late when
   its prefill ends after the deadline; the live gateway hears it when the
   prefill engine answers).
5. **TTFT** is when the client receives the first text token, and the token
   counted is the one the prefill engine sampled: the decode engine streams it
   at the start of the first pass after the KV arrived and it was admitted
   (SGLang's prebuilt batch), then decodes the rest. The client's stream is the
   decode engine's. For the controller it counts for the decode engine, late
   when it reaches the client after the deadline although the prefill was
   done by then (the transfer and the decode admission made it late).

A failure on either side (no decode engine, a 400 from the prefill engine) is
one error to the client; a timeout withdraws the request from wherever it is
(prefill engine, link, decode engine). ``transfers`` keeps every finished
transfer (its :attr:`~engines.sim.kv_transfer.Transfer.inflation` over an idle
link measures the burst effect).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engines.sim.core import RequestEvent
from engines.sim.kv_transfer import KvTransferNetwork, Transfer, kv_transfer_bytes
from engines.sim.latency import MODELS
from laps.config import Config
from laps.tokenizer import ChatTokenizer
from loadgen.report import summarize
from loadgen.virtual import CALL, NO_ENGINE_MESSAGE, EngineSlot, SimRequest, VirtualRun
from policies.controller import Move
from policies.registry import make_decode_placement


@dataclass(slots=True)
class _PD:
    """Where one dispatched request is on its way through a PD deployment."""

    prefill_id: str
    decode_id: str
    prefill_cached: int = 0
    prefill_held: bool = True  # still counts as in flight on its prefill engine
    prefill_done_s: float = float("inf")  # when the prefill engine sampled the first token


class VirtualPDRun(VirtualRun):
    """One simulated run of a PD deployment (see the module doc); single use.

    ``shared_links`` False gives every KV transfer the whole link (the
    no-contention reference for the burst measurement). Arguments otherwise as
    for :class:`VirtualRun`.

    Raises:
        ValueError: ``config`` has no ``pd:`` section (or no decode engine), or as :class:`VirtualRun`.
    """

    def __init__(self, config: Config, tokenizer: ChatTokenizer, *, shared_links: bool = True, **kwargs: Any) -> None:
        if config.pd is None:
            raise ValueError("VirtualPDRun needs a prefill-decode deployment: add the pd: section and decode engines")
        super().__init__(config, tokenizer, **kwargs)
        self._engine_ids = [e.id for e in self.registry.views()]  # prefix hits matter on prefill engines only
        self.placement = make_decode_placement(config.scheduling)
        self.network = KvTransferNetwork(config.pd.link_bytes_per_s, shared=shared_links)
        self.kv_bytes_per_token = MODELS[config.sim.model].kv_bytes_per_token
        self.transfers: list[Transfer] = []
        self._pd: dict[str, _PD] = {}
        self._transfer_gen = 0

    # ---- dispatch: a prefill engine from the scheduler, a decode engine from the placement ------

    def summary(self) -> dict[str, Any]:
        """:meth:`VirtualRun.summary` plus ``kv_transfer``: the finished transfers' ``count``,
        ``bytes`` (total), ``time_s`` and ``inflation`` statistics (:func:`loadgen.report.summarize`)."""
        return {**super().summary(), "kv_transfer": {
            "count": len(self.transfers),
            "bytes": sum(t.nbytes for t in self.transfers),
            "time_s": summarize(t.end_s - t.start_s for t in self.transfers),
            "inflation": summarize(t.inflation for t in self.transfers),
        }}

    def _engine_in(self, req: SimRequest, engine: EngineSlot) -> None:
        if req.done:
            return
        rid = req.view.rid
        decode_id = self.placement.pick(rid, req.view.prompt_tokens, self.registry.decode_views(), self.now)
        if decode_id is None:
            self._fail_now(req, 503, NO_ENGINE_MESSAGE)
            return
        self.registry.acquire(decode_id, req.view.prompt_tokens)
        self._pd[rid] = _PD(engine.id, decode_id)
        super()._engine_in(req, engine)

    def _fail_now(self, req: SimRequest, status: int, message: str) -> None:
        """Fail a request on its way in (inside a decision: after it, as :class:`VirtualRun` does)."""
        if self._delayed_in:
            self._fail(req, status, message)
            self._release(req)
        else:
            self._failures.append((req, status, message))

    # ---- events -------------------------------------------------------------------------------

    def _joined(self, move: Move, role: str, kind: str) -> None:
        """:meth:`VirtualRun._joined`; an engine that changed sides leaves (or joins) the prefix hits' engines."""
        super()._joined(move, role, kind)
        self._engine_ids = [e.id for e in self.registry.views()]

    def _deliver(self, engine_id: str, events: tuple[RequestEvent, ...]) -> None:
        if self.engines[engine_id].core.config.disaggregation_mode == "decode":
            self._deliver_decode(engine_id, events)
            return
        for ev in events:
            req = self._requests.get(ev.rid)
            state = self._pd.get(ev.rid)
            if req is None or req.done or state is None or not ev.kv_ready:
                continue  # withdrawn, or the end of a transfer we already handled
            state.prefill_cached = ev.cached_tokens
            state.prefill_done_s = self.now
            self.prefix_index.in_flight.end(ev.rid)
            if self.controller is not None:
                self.first_tokens.record(engine_id, self.now, req.view.deadline_s)
            self.scheduler.on_first_token(ev.rid, engine_id, self.now, ev.cached_tokens)
            self._decide()
            nbytes = kv_transfer_bytes(self.kv_bytes_per_token, ev.prompt_tokens, self.engines[engine_id].core.latency.tp_size)
            self.network.start(ev.rid, engine_id, state.decode_id, nbytes, self.now)
            self._schedule_transfers()

    def _schedule_transfers(self) -> None:
        self._transfer_gen += 1
        t = self.network.next_done_s()
        if t is not None:
            gen = self._transfer_gen
            self._push(max(t, self.now), CALL, lambda: self._on_transfers(gen))

    def _on_transfers(self, gen: int) -> None:
        if gen != self._transfer_gen:
            return  # rates changed since; a later call is scheduled
        for transfer in self.network.pop_done(self.now):
            self.transfers.append(transfer)
            self._transfer_done(transfer)
        self._schedule_transfers()

    def _transfer_done(self, transfer: Transfer) -> None:
        """The KV is on the decode engine: the prefill engine lets go, the decode engine takes the request."""
        rid = transfer.tid
        req, state = self._requests.get(rid), self._pd.get(rid)
        if req is None or req.done or state is None:
            return  # withdrawn while its KV was on the way
        prefill = self.engines[transfer.src]
        prefill.core.finish_transfer(rid)
        if prefill.core.has_work() and not prefill.busy and prefill not in self._to_kick:
            self._to_kick.append(prefill)  # the freed KV may admit what waited for room
        self.prefix_index.observe(transfer.src, req.keys, state.prefill_cached, req.view.cached_by_engine.get(transfer.src, 0))
        self._release_prefill(req)
        req.engine_id = state.decode_id  # from now on the request is the decode engine's
        decode = self.engines[state.decode_id]
        try:
            decode.core.add_transferred_request(rid, req.prompt_ids, req.record.max_tokens, self.ignore_eos, (), self.now)
        except ValueError as err:  # the decode engine refuses it (e.g. its pool is smaller than the prompt)
            self._fail(req, 400, str(err))
            self._release(req)
            return
        if not decode.busy and decode not in self._to_kick:
            self._to_kick.append(decode)

    def _deliver_decode(self, engine_id: str, events: tuple[RequestEvent, ...]) -> None:
        now = self.now
        for ev in events:
            req = self._requests.get(ev.rid)
            if req is None or req.done:
                continue
            self._record_tokens(req, ev)
            if ev.first_token:
                self.placement.on_progress(ev.rid, 1, now)
                if self.controller is not None:  # late because of the decode side (module doc)
                    deadline = req.view.deadline_s
                    self.first_tokens.record_late(engine_id, now, now > deadline >= self._pd[ev.rid].prefill_done_s)
            if ev.finished:
                self._complete(req, ev)

    def _complete(self, req: SimRequest, ev: RequestEvent) -> None:
        rec = req.record
        rec.end_s = self.now
        rec.prompt_tokens, rec.completion_tokens = ev.prompt_tokens, ev.completion_tokens
        rec.cached_tokens = self._pd[req.view.rid].prefill_cached  # the prefix hit is the prefill engine's
        rec.e2e_s = rec.end_s - rec.start_s
        if rec.ttft_s is not None and ev.completion_tokens > 1:
            rec.tpot_s = (rec.e2e_s - rec.ttft_s) / (ev.completion_tokens - 1)
        if ev.finish_reason == "abort":
            rec.error = "HTTP 500: the decode engine aborted the request (its KV pool could not hold it)"
        self._end(req)
        self._release(req)

    # ---- withdrawal and release ----------------------------------------------------------------

    def _on_timeout(self, req: SimRequest) -> None:
        state = self._pd.get(req.view.rid)
        if req.done or state is None:
            super()._on_timeout(req)  # not dispatched yet (or already over)
            return
        req.record.error = f"timeout after {self.request_timeout_s:g} s"
        req.record.end_s = self.now
        self._end(req)
        self._release(req)  # the gateway aborts it on both engines

    def _release_prefill(self, req: SimRequest) -> None:
        """The request no longer counts on its prefill engine (scheduler told, controller drain checked)."""
        state = self._pd[req.view.rid]
        if state.prefill_held:
            state.prefill_held = False
            super()._release(req)

    def _release(self, req: SimRequest) -> None:
        """Let go of whatever the request still holds: prefill engine, link, decode engine and placement."""
        rid = req.view.rid
        state = self._pd.get(rid)
        if state is None:  # failed before a decode engine was chosen
            super()._release(req)
            return
        if state.prefill_held:
            self.engines[state.prefill_id].core.abort(rid)  # no-op once it has finished there
        if self.network.cancel(rid, self.now) is not None:
            self._schedule_transfers()
        self.engines[state.decode_id].core.abort(rid)
        self.registry.release(state.decode_id, req.view.prompt_tokens)
        self.placement.on_done(rid, self.now)
        self._release_prefill(req)
        del self._pd[rid]
        self._check_drain(state.decode_id)

