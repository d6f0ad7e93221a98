"""The deployment configuration: one YAML file loaded into pydantic models.

Loading runs in three stages: parse YAML -> fill defaults -> validate. Any
failure raises :class:`ConfigError` whose message names the file, the key path
(``engines.1.role``), the offending value and what is allowed.
"""

from __future__ import annotations

import re
import reprlib
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engines.sim.kv_transfer import LINKS
from laps.api_keys import load_keys
from policies.backlog_scheduler import BacklogConfig
from policies.controller import PressureControllerConfig
from policies.decode_placement import AlignedPlacementConfig
from policies.laps import LapsConfig

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "config.yaml"
# Client API keys (``gateway.api_keys``) shorter than this are refused: a short key is a guessable key.
MIN_API_KEY_CHARS = 8
# The longest any of the gateway's timeouts may be (seconds): a week, far past any generation; the HTTP client takes
# its timeouts as a ``datetime.timedelta``, which overflows past ~8.6e13 s.
MAX_TIMEOUT_S = 7 * 86_400.0

FlagValue = bool | int | float | str | list[int]


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message says where and why."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    """The served model.

    ``path`` names a Hugging Face model directory whose tokenizer and chat
    template the gateway uses; ``None`` means the built-in Qwen2.5 vocabulary
    with the ChatML template.
    """

    name: str = Field("Qwen2.5-7B-Instruct", min_length=1)
    path: Path | None = None


class GatewayConfig(_Strict):
    """Where the gateway listens, how long it waits for an engine, how it shuts down, and its keys.

    ``request_timeout_s``: the longest a whole generation may take at an engine.
    ``first_byte_timeout_s``: the longest a stream may wait for its engine's first byte (queueing at the
    engine plus the prefill); ``stall_timeout_s``: the longest it may wait between two chunks after that.
    A request cut off before its client got anything is retried once on another engine; a started stream
    ends with an error event and ``[DONE]``. The defaults leave a margin over an engine's worst honest
    pass: the longest pass of the shipped roles, a 16,384-token prefill chunk on 16,384 cached tokens,
    takes 0.6 s for Qwen2.5-7B on an H200 and 7.2 s for Qwen2.5-32B on an A100 (the simulator's engine
    model, :mod:`engines.sim.latency`); a decode stream may wait out several such passes.
    ``shutdown_grace_s``: on SIGTERM/Ctrl-C, how long requests in flight may still run before those left
    end with an error (streams: an error event and ``[DONE]``; others: 503).
    ``keepalive_timeout_s``: the longest a client connection may go without a whole request head, counted
    from the connection's opening or from the end of its previous response: an idle keep-alive connection
    and one that sends its headers slowly (slowloris) are both closed then, without an answer (aiohttp's
    ``keepalive_timeout``, which bytes arriving do not restart; the default outlasts the 60 s idle timeout
    of common proxies and load balancers, so they, not the gateway, close their pooled connections).
    ``body_timeout_s``: the longest a request's body may take to arrive once its head is in; then the
    request gets 408 ``request_timeout`` and its connection is closed (aiohttp first reads and discards
    what still comes, for up to 10 s). Neither limit applies once a request is being answered: a reply,
    streamed or not, may take up to ``request_timeout_s``. A request line or header line over 8,190 bytes,
    or more than 128 headers, gets aiohttp's plain-text 400 (its limits).
    ``admin_key``: the admin API's key (``None`` turns the admin API off). ``api_keys``: client keys for
    the ``/v1`` API, a list of keys or the path of a file of their SHA-256 digests
    (:mod:`laps.api_keys`), each at least ``MIN_API_KEY_CHARS`` characters; ``None`` lets every client in.
    ``tokenizer_processes``: worker processes that tokenize prompts (and replies) of at least
    ``tokenizer_process_min_chars`` new characters off the event loop (:class:`laps.chat_cache.EncodePool`;
    0: executor threads of the gateway process, as for mid-size texts).
    ``workers``: gateway processes that share the port (``SO_REUSEPORT``) and do HTTP, validation,
    tokenization and relaying, while one scheduler process keeps the scheduling state (:mod:`gateway.workers`);
    1: everything in one process.
    ``listen_backlog``: the length of the listening socket's queue of connections the kernel has accepted and the
    gateway not yet taken (``listen(2)``'s backlog; Linux caps it at ``net.core.somaxconn``, 4096 by default), each
    worker's socket's with ``workers`` > 1: a burst of new connections beyond it waits for the clients' SYN retries
    (a second or more) or fails. The default is uvicorn's, which SGLang serves with; aiohttp's own is 128.
    """

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    request_timeout_s: float = Field(600.0, gt=0, le=MAX_TIMEOUT_S)
    first_byte_timeout_s: float = Field(60.0, gt=0, le=MAX_TIMEOUT_S)
    stall_timeout_s: float = Field(30.0, gt=0, le=MAX_TIMEOUT_S)
    shutdown_grace_s: float = Field(30.0, ge=0, le=MAX_TIMEOUT_S)
    keepalive_timeout_s: float = Field(75.0, gt=0, le=MAX_TIMEOUT_S)
    body_timeout_s: float = Field(60.0, gt=0, le=MAX_TIMEOUT_S)
    admin_key: str | None = Field(None, min_length=8)
    api_keys: list[str] | Path | None = Field(None, union_mode="left_to_right")
    tokenizer_processes: int = Field(2, ge=0, le=256)
    tokenizer_process_min_chars: int = Field(32768, gt=0)
    workers: int = Field(1, ge=1, le=256)
    listen_backlog: int = Field(2048, ge=1)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _keys_long_enough(cls, keys: Any) -> Any:
        if isinstance(keys, list):
            for i, key in enumerate(keys):
                if isinstance(key, str) and len(key) < MIN_API_KEY_CHARS:
                    raise ValueError(f"key {i} is {len(key)} characters; client keys must be at least {MIN_API_KEY_CHARS} characters")
        return keys

    @field_validator("api_keys")
    @classmethod
    def _keys_load(cls, keys: list[str] | Path | None) -> list[str] | Path | None:
        if isinstance(keys, list) and not keys:
            raise ValueError("an empty list lets nobody in; leave api_keys out (or null) to let every client in")
        if keys is not None:
            load_keys(keys)  # a missing or malformed key file fails here, before any engine starts
        return keys


class TracingConfig(_Strict):
    """OpenTelemetry tracing of requests (``gateway/tracing.py``), off by default: spans go by OTLP over HTTP
    (protobuf) to ``endpoint`` under ``service_name``; ``sample_ratio`` of the traces a request starts are kept
    (a ``traceparent`` from the client decides for its own trace)."""

    enabled: bool = False
    endpoint: str = "http://127.0.0.1:4318/v1/traces"
    service_name: str = "laps-gateway"
    sample_ratio: float = Field(1.0, ge=0, le=1)


class SLOConfig(_Strict):
    """Service-level objectives; ``ttft_s`` is the time-to-first-token target in seconds.

    ``ttft_per_1k_new_tokens_s``: the optional length-aware objective, ``ttft_s`` plus this many
    seconds per 1,000 new (uncached) prompt tokens, so a long prefill is judged on what is
    achievable (a 30k-token prefill alone takes ~1 s on one H200 with Qwen2.5-7B). When set,
    reports give its violation rate next to the fixed one, and laps schedules a request whose
    prefill alone would end past ``ttft_s`` (no scheduler can meet the fixed objective for it) to
    the length-aware deadline; every other request keeps ``ttft_s``.
    """

    ttft_s: float = Field(0.4, gt=0)
    ttft_per_1k_new_tokens_s: float | None = Field(None, ge=0)

    def length_deadline_s(self, arrival_s: float, new_tokens: int) -> float | None:
        """The length-aware TTFT deadline of a request arriving at ``arrival_s`` with ``new_tokens`` uncached prompt
        tokens (seconds on the same clock); None without ``ttft_per_1k_new_tokens_s``."""
        if self.ttft_per_1k_new_tokens_s is None:
            return None
        return arrival_s + self.ttft_s + self.ttft_per_1k_new_tokens_s * new_tokens / 1000


class CostModelConfig(_Strict):
    """Fitted prefill cost model (DESIGN §2.3 plus the per-pass memory floor m0), seconds;
    see :class:`policies.classifier.PrefillCostModel`. ``laps calibrate`` writes it."""

    alpha: float = Field(gt=0)
    beta: float = Field(ge=0)
    gamma_w: float = Field(ge=0)
    gamma_r: float = Field(ge=0)
    memory_floor_s: float = Field(0.0, ge=0)


class SchedulingConfig(_Strict):
    """Length-aware scheduling parameters.

    ``short_threshold_tokens``: a request whose new (uncached) prompt tokens are
    fewer than this is a short prefill; the LAPS fallback boundary is 256.
    ``cost_model``: when set, the boundary is L_m(H) of this fitted model instead.
    ``prefix_block_tokens``: block size of the gateway's prefix-cache estimate;
    ``prefix_index_bytes``: its memory budget over all engines (each engine's
    share is further capped at that engine's KV pool); ``chat_cache_bytes``: the
    memory budget of the tokenized chats the gateway keeps so that a
    conversation's next turn tokenizes only its new message (:mod:`laps.chat_cache`).
    ``kv_events``: follow each engine's KV cache events (SGLang
    ``--kv-events-config``) so that its prefix hits are exact
    (:mod:`policies.exact_prefix`); laps adds the flag to the engines it starts,
    an ``external`` engine is followed at its ``kv_events_endpoint``; an engine
    that publishes nothing is estimated. Each engine's page size (its role's
    ``page-size`` flag, default 1) must divide ``prefix_block_tokens``.
    ``policy``: the scheduler (see :data:`policies.registry.POLICIES`): ``laps``
    (predicted-TTFT routing, gated long prefills, AWD windows if asked), ``pools`` (short/long pools, no
    window), or a baseline over all engines: ``least_load`` (unified FCFS),
    ``round_robin``, ``cache_aware``, ``bucket``; or ``aligned`` (AlignedServe
    decode placement over all engines, :class:`policies.decode_placement.AlignedPlacement`);
    ``laps``: its parameters.
    ``decode_placement``: how the engine that decodes a request is chosen where several
    decode (PD decode engines): ``least_load`` (fewest in flight) or ``aligned`` (keep
    each engine's running set in a narrow context-length band, with a starvation guard);
    ``aligned``: that placement's parameters (also used by ``policy: aligned``).
    With ``pd:`` the policy places prefills, so ``aligned`` and ``backlog`` are refused
    there (:data:`PD_PREFILL_POLICIES`); without ``pd:`` ``decode_placement`` must stay
    ``least_load`` (nothing reads it).
    ``policy: backlog`` queues requests in the gateway and admits them against each
    engine's KV pool in a Sorted-F, MC-SF or FCFS order (:class:`policies.backlog_scheduler.BacklogScheduler`);
    ``backlog``: its parameters.
    """

    policy: Literal["laps", "pools", "least_load", "round_robin", "cache_aware", "bucket", "aligned", "backlog"] = "laps"
    laps: LapsConfig = LapsConfig()
    backlog: BacklogConfig = BacklogConfig()
    decode_placement: Literal["least_load", "aligned"] = "least_load"
    aligned: AlignedPlacementConfig = AlignedPlacementConfig()
    short_threshold_tokens: int = Field(256, ge=1)
    cost_model: CostModelConfig | None = None
    prefix_block_tokens: int = Field(16, ge=1)
    prefix_index_bytes: int = Field(64 * 2**20, ge=1024)
    chat_cache_bytes: int = Field(64 * 2**20, ge=0)
    kv_events: bool = True


def _int_or_none(value: object) -> int | None:
    """``value`` (a flag's value as YAML gave it; None: unset) as an integer, or None where it is not one."""
    try:
        return int(str(value).strip())
    except ValueError:
        return None


class RoleConfig(_Strict):
    """A named set of engine flags, spelled as SGLang spells them without ``--``.

    ``pool`` says which request class the role serves: ``short`` or ``long``
    prefills, or ``decode`` (a decode-only engine of a prefill–decode
    disaggregated deployment; needs the ``pd:`` section).

    ``late_requests_last``: start the role's engines with laps' SGLang plugin
    (``engines/sglang_plugin``), which makes ``shortest-prefill-first`` put a
    request that has waited longer than ``slo.ttft_s`` (never the per-1k allowance) behind those
    still within theirs, so that in overload the engine spends its passes on
    requests that can still be in time (needs ``schedule-policy:
    shortest-prefill-first``; simulated engines model it).
    ``deadline_order`` (needs ``late_requests_last``): the plugin also puts the
    requests in time that have ``scheduling.short_threshold_tokens`` new tokens
    or more behind the shorter ones in Moore's order: by deadline, less the
    longest ones wherever by its estimate (the chunked prefill in progress, then
    prefills back to back, at the engine's full-chunk rate in the ``sim``
    section's engine model: set ``sim`` to the real engine's model and GPU) one
    would end late; those follow, shortest first (``engines/sglang_plugin``).
    The gateway's queue model keeps predicting shortest first there
    (``policies/ttft_model.py`` says why).
    ``short_pass`` (needs ``deadline_order``): a prefill pass whose queue, so
    ordered, starts with requests in time of fewer than
    ``scheduling.short_threshold_tokens`` new tokens holds at most that many
    tokens (or what they need, where more) instead of filling the chunk with a long
    prefill's next tokens, so such a request behind a long prefill waits for
    the pass in progress and a memory-bound pass of its own, not a whole chunk
    pass (``engines/sglang_plugin``).
    ``decode_turns`` (needs ``late_requests_last`` and
    ``flags.prefill-decode-interval``, SGLang's decode passes owed after each
    prefill pass while ``flags.prefill-decode-interval-min-bs`` requests run):
    the plugin keeps an owed decode pass only while no chunked prefill is in
    progress and every waiting request has fewer than
    ``scheduling.short_threshold_tokens`` new tokens, so a stream of short
    prompts cannot starve decode (no request would finish, no request slot
    free) and a long prefill is not stretched by a decode pass per chunk
    (``engines/sglang_plugin``).
    """

    pool: Literal["short", "long", "decode"]
    flags: dict[str, FlagValue] = Field(default_factory=dict)
    late_requests_last: bool = False
    deadline_order: bool = False
    short_pass: bool = False
    decode_turns: bool = False

    @model_validator(mode="after")
    def _check_late_requests_last(self) -> "RoleConfig":
        policy = self.flags.get("schedule-policy")
        if self.late_requests_last and policy != "shortest-prefill-first":
            here = "unset here: SGLang's default fcfs" if policy is None else f"here: {policy}"
            raise ValueError(f"late_requests_last reorders the queue of shortest-prefill-first: it needs "
                             f"flags.schedule-policy: shortest-prefill-first ({here})")
        if self.deadline_order and not self.late_requests_last:
            raise ValueError("deadline_order is part of laps' SGLang plugin: it needs late_requests_last: true")
        if self.short_pass and not self.deadline_order:
            raise ValueError("short_pass takes its short requests from the plugin's deadline order: it needs "
                             "deadline_order: true")
        chunk = _int_or_none(self.flags.get("chunked-prefill-size"))
        if self.short_pass and chunk is not None and chunk <= 0:
            raise ValueError("short_pass cuts a pass's chunk budget: it needs chunked prefill, not "
                             f"flags.chunked-prefill-size: {chunk} (SGLang turns chunking off at 0 or less)")
        if self.decode_turns and not self.late_requests_last:
            raise ValueError("decode_turns is part of laps' SGLang plugin: it needs late_requests_last: true")
        interval = _int_or_none(self.flags.get("prefill-decode-interval"))
        if self.decode_turns and not (interval is not None and interval >= 1):
            here = self.flags.get("prefill-decode-interval", "unset")
            raise ValueError("decode_turns keeps or drops the decode passes SGLang's prefill-decode-interval owes: it "
                             f"needs flags.prefill-decode-interval >= 1 (here: {here})")
        return self

    def same_engine(self, other: "RoleConfig") -> bool:
        """Whether an engine runs the same with ``other``: every key but ``pool`` (the flags and the plugin's keys) equal."""
        return self.model_dump(exclude={"pool"}) == other.model_dump(exclude={"pool"})


class SimConfig(_Strict):
    """Hardware the simulated engines model: a model preset and a GPU preset; ``calibration``: a
    calibration file from ``bench/gpu_check.py`` whose measured efficiencies replace the shipped ones."""

    model: Literal["qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b"] = "qwen2.5-7b"
    gpu: Literal["h200", "h100", "a100"] = "h200"
    calibration: Path | None = None


class SGLangConfig(_Strict):
    """How ``kind: sglang`` engines are launched (``python -m sglang.launch_server``).

    ``python``: the interpreter that has ``sglang`` 0.5.23 installed; ``null``
    means the gateway's own. ``extra_args``: arguments appended to every SGLang
    command line, after the role's flags, so they override them (e.g.
    ``--device cpu --load-format dummy ...`` to test on a machine without a
    GPU). ``env``: environment variables added to every SGLang process's
    environment.
    """

    python: Path | None = None
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)


PD_FLAGS = ("disaggregation-mode", "disaggregation-transfer-backend", "disaggregation-bootstrap-port", "enable-pd-role-switch")
"""The SGLang flags laps sets on every engine of a PD deployment (from ``pd:`` and the role's pool); roles may not."""


class PDConfig(_Strict):
    """Prefill–decode disaggregation (SGLang 0.5.23 ``--disaggregation-*``); present = on.

    Engines whose role's pool is ``short`` or ``long`` run ``--disaggregation-mode
    prefill``, those in the ``decode`` pool ``--disaggregation-mode decode``; the
    gateway sends each request to one prefill and one decode engine at once.
    ``transfer_backend``: SGLang's KV transfer backend on both sides.
    ``bootstrap_port``: the base of the prefill engines' KV bootstrap ports:
    engine ``i`` of ``engines`` listens on ``bootstrap_port + i`` (at most
    65535, and clear of the gateway's and the engines' HTTP ports), an external
    prefill engine on ``bootstrap_port`` itself (8998, SGLang's own default,
    unless changed), unless the engine sets its own ``bootstrap_port`` (decode
    engines take none, unless ``role_switch``). ``link``: the KV link the simulated engines
    model (a preset of :data:`engines.sim.kv_transfer.LINKS`); ``link_gb_s``
    overrides its bandwidth (GB/s per port and direction).

    ``role_switch``: every engine laps runs gets ``--enable-pd-role-switch``
    and a bootstrap port of its own (decode engines too: SGLang 0.5.23 then runs
    the bootstrap server on every PD instance), so a move between a prefill role
    and a decode role with the same flags (and plugin) flips the idle engine with ``POST
    /pd_role_switch`` instead of restarting it (:mod:`gateway.role_switch`);
    SGLang refuses it on the ``nixl`` backend. ``decode_cuda_graph_memory_gb``:
    what such a flip to decode says the decode CUDA graphs will take (SGLang
    requires the figure when the engine has none captured yet, and refuses the
    flip when less GPU memory is free). Our estimate for Qwen2.5-7B on one H200,
    not a measurement; a decode engine's ``/v1/loads?include=memory``
    ``memory.graph_gb`` is the measured figure.
    """

    transfer_backend: Literal["mooncake", "nixl", "mooncake_tcp", "mori", "ascend"] = "mooncake"
    bootstrap_port: int = Field(8998, ge=1, le=65535)
    link: Literal[tuple(LINKS)] = "nvlink"  # type: ignore[valid-type]
    link_gb_s: float | None = Field(None, gt=0)
    role_switch: bool = False
    decode_cuda_graph_memory_gb: float = Field(2.0, ge=0)

    @model_validator(mode="after")
    def _check_role_switch(self) -> "PDConfig":
        if self.role_switch and self.transfer_backend == "nixl":
            raise ValueError("role_switch: SGLang 0.5.23's nixl transfer backend does not support a runtime role switch; "
                             "use mooncake, mooncake_tcp, mori or ascend, or turn role_switch off")
        return self

    @property
    def link_bytes_per_s(self) -> float:
        """The KV link's bandwidth in bytes per second (``link_gb_s``, else the ``link`` preset)."""
        return self.link_gb_s * 1e9 if self.link_gb_s is not None else LINKS[self.link].bandwidth_bytes_per_s


class NodeConfig(_Strict):
    """The machine laps runs on: ``gpus`` is its GPU count (valid GPU ids are ``0 .. gpus-1``)."""

    gpus: int = Field(8, ge=0)


class EngineConfig(_Strict):
    """One engine.

    ``kind``: ``sglang`` runs a real SGLang server (see :class:`SGLangConfig`),
    ``sim`` the simulated SGLang-compatible engine; both are started by laps on
    127.0.0.1 with the role's flags, ``--tp-size`` = the number of ``gpus``,
    and ``CUDA_VISIBLE_DEVICES`` = ``gpus`` (none: inherited). ``port: null``
    picks a free loopback port at start. ``external`` is an engine that runs
    elsewhere, at ``url`` (``http://host:port``): laps starts, stops and
    restarts nothing there, and it takes neither ``gpus`` nor ``port``; its
    role only names its pool. ``bootstrap_port``: with ``pd:``, where this
    engine serves SGLang's KV bootstrap when it prefills (default: see
    :class:`PDConfig`). ``kv_events_endpoint`` / ``kv_events_replay_endpoint``:
    where an ``external`` engine publishes its KV cache events and serves their
    replay (its ``--kv-events-config`` ``endpoint`` and ``replay_endpoint``, as
    reachable from here); laps picks them itself for the engines it starts.
    """

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    kind: Literal["sglang", "sim", "external"] = "sim"
    role: str
    gpus: list[int] = Field(default_factory=list)
    port: int | None = Field(None, ge=1, le=65535)
    url: str | None = Field(None, pattern=r"^https?://[^/\s]+$")
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    kv_events_endpoint: str | None = Field(None, pattern=r"^(tcp|ipc)://\S+$")
    kv_events_replay_endpoint: str | None = Field(None, pattern=r"^(tcp|ipc)://\S+$")


class ControllerConfig(PressureControllerConfig):
    """The pressure controller that moves engines between the short and long pools (DESIGN §2.7).

    The pressure parameters (``queue_weight`` … ``min_pool_size``) are those of
    :class:`policies.controller.PressureControllerConfig`. ``enabled`` turns it
    on (gateway and simulator); a file that does not say is on wherever it can
    work (:meth:`Config._controller_on_where_it_can`); ``interval_s``: seconds between decisions;
    ``window_s``: the recent window of first tokens over which an engine's TTFT
    SLO-violation share is taken; ``min_first_tokens``: that share is the late first tokens over at least this
    many (fewer in the window count as on time), so one slow first token on a quiet engine (a cold start) moves
    nothing; ``short_role`` / ``long_role``: the role an
    engine is restarted with when it moves into that pool (each must be defined
    under ``roles`` and serve that pool: checked when ``enabled``, or when set
    explicitly); ``drain_timeout_s``: how long a moving
    engine's in-flight requests may run before they fail.

    In a PD deployment with ``pd.role_switch`` the controller also sizes the
    decode pool (:mod:`policies.pd_controller`, the ``decode_*`` parameters):
    an engine moving into it takes ``decode_role`` (a role of the ``decode``
    pool; checked then), one leaving it the role of the prefill pool it joins.
    A move between sides whose roles have the same flags (and plugin) is a flip (no
    restart, :meth:`Config.pd_flip`); otherwise a restart.

    ``sim_restart_s`` is what the virtual-time simulator charges for the
    restart itself (the engine serves nothing meanwhile): 40 s, our estimate
    for SGLang 0.5.23 with Qwen2.5-7B on one H200, not a measurement: a fresh
    process imports torch and sglang (~10 s), reads 15 GB of bf16 weights from
    the page cache or NVMe (~5–10 s), sizes the KV pool, then captures decode
    CUDA graphs for its batch sizes and, for ``short-prefill``, the prefill
    graphs of each token bucket (~10–20 s). Live engines take what they take.
    """

    enabled: bool = False
    interval_s: float = Field(2.0, gt=0)
    window_s: float = Field(30.0, gt=0)
    min_first_tokens: int = Field(10, ge=1)
    short_role: str = "short-prefill"
    long_role: str = "long-prefill"
    decode_role: str = "decode"
    drain_timeout_s: float = Field(60.0, ge=0)
    sim_restart_s: float = Field(40.0, ge=0)

    def pressure_config(self) -> PressureControllerConfig:
        """The pure controller's parameters out of this section."""
        return PressureControllerConfig(**self.model_dump(include=set(PressureControllerConfig.model_fields)))

    def role_for(self, pool: str) -> str:
        """The role an engine moving into ``pool`` (``"short"``, ``"long"`` or ``"decode"``) takes."""
        return {"short": self.short_role, "long": self.long_role, "decode": self.decode_role}[pool]


class Config(_Strict):
    """The whole deployment (the root of ``config.yaml``)."""

    model: ModelConfig = ModelConfig()
    gateway: GatewayConfig = GatewayConfig()
    tracing: TracingConfig = TracingConfig()
    slo: SLOConfig = SLOConfig()
    scheduling: SchedulingConfig = SchedulingConfig()
    sim: SimConfig = SimConfig()
    sglang: SGLangConfig = SGLangConfig()
    node: NodeConfig = NodeConfig()
    controller: ControllerConfig = ControllerConfig()
    pd: PDConfig | None = None
    roles: dict[str, RoleConfig]
    engines: list[EngineConfig] = Field(min_length=1)
    log_dir: Path = Path("runs/logs")

    @model_validator(mode="before")
    @classmethod
    def _controller_on_where_it_can(cls, data: Any) -> Any:
        """``controller.enabled`` left unset: on when its two roles exist and serve the short and long pools
        and a pool has more engines that laps runs (not ``external``) than ``min_pool_size``, so that it can give one
        up (:meth:`policies.controller.PressureController.donor_engine`; the decode pool too with ``pd.role_switch``),
        else off."""
        if not isinstance(data, dict) or not isinstance(data.get("roles"), dict) or not isinstance(data.get("engines"), list):
            return data
        controller = data.get("controller") or {}
        if not isinstance(controller, dict) or "enabled" in controller:
            return data
        roles = data["roles"]

        def pool_of(role: Any) -> Any:
            return roles[role].get("pool") if isinstance(role, str) and isinstance(roles.get(role), dict) else None

        short_role = controller.get("short_role", ControllerConfig.model_fields["short_role"].default)
        long_role = controller.get("long_role", ControllerConfig.model_fields["long_role"].default)
        pd = data.get("pd")
        flips = isinstance(pd, dict) and pd.get("role_switch") is True  # the decode pool is sized too: it can give one up
        movable = {pool: sum(isinstance(e, dict) and e.get("kind") != "external" and pool_of(e.get("role")) == pool
                             for e in data["engines"]) for pool in ("short", "long", *(("decode",) if flips else ()))}
        min_pool = controller.get("min_pool_size", ControllerConfig.model_fields["min_pool_size"].default)
        on = (pool_of(short_role) == "short" and pool_of(long_role) == "long"
              and isinstance(min_pool, (int, float)) and max(movable.values()) > min_pool)
        return {**data, "controller": {**controller, "enabled": on}}

    @model_validator(mode="after")
    def _check_references(self) -> "Config":
        seen: set[str] = set()
        gpu_owner: dict[int, str] = {}
        for i, engine in enumerate(self.engines):
            if engine.role not in self.roles:
                allowed = f"allowed: {', '.join(sorted(self.roles))}" if self.roles else "roles defines none"
                raise ValueError(f"engines.{i}.role: {engine.role!r} is not a role defined under roles; {allowed}")
            if engine.name in seen:
                raise ValueError(f"engines.{i}.name: {engine.name!r} is used by more than one engine")
            seen.add(engine.name)
            _check_kind(i, engine)
            for gpu in engine.gpus:
                if not 0 <= gpu < self.node.gpus:
                    raise ValueError(f"engines.{i}.gpus: GPU {gpu} does not exist; node.gpus is {self.node.gpus}, so ids are 0..{self.node.gpus - 1}")
                if gpu in gpu_owner:
                    raise ValueError(f"engines.{i}.gpus: GPU {gpu} is already given to engine {gpu_owner[gpu]!r}; a GPU serves one engine")
                gpu_owner[gpu] = engine.name
        _check_controller_roles(self)
        _check_pd(self, _http_ports(self))
        _check_scheduling(self)
        _check_kv_events(self)
        return self

    def pool(self, engine: EngineConfig) -> str:
        """The pool (``"short"``, ``"long"`` or ``"decode"``) that ``engine``'s role serves."""
        return self.roles[engine.role].pool

    def instant_move(self, current_role: str, new_role: str) -> bool:
        """Whether an engine running ``current_role`` takes ``new_role`` without a restart or a drain: the two
        roles give the engine the same flags (and plugin) and the same side of a PD deployment (prefill or decode), so only
        what the gateway sends it changes (its pool)."""
        current, new = self.roles[current_role], self.roles[new_role]
        return current.same_engine(new) and (current.pool == "decode") == (new.pool == "decode")

    def pd_flip(self, current_role: str, new_role: str) -> bool:
        """Whether an engine running ``current_role`` takes ``new_role`` by SGLang's runtime role switch (drained,
        then ``POST /pd_role_switch``, no restart): ``pd.role_switch`` is on, one role is a prefill role and the
        other the decode role, and the two give the engine the same flags (and plugin)."""
        current, new = self.roles[current_role], self.roles[new_role]
        return (self.pd is not None and self.pd.role_switch and current.same_engine(new)
                and (current.pool == "decode") != (new.pool == "decode"))

    def controller_sizes_decode(self) -> bool:
        """Whether the controller moves engines between the prefill and decode sides: it is on, and the
        deployment is PD with ``pd.role_switch`` (:mod:`policies.pd_controller`)."""
        return self.controller.enabled and self.pd is not None and self.pd.role_switch

    def serves_bootstrap(self, engine: EngineConfig) -> bool:
        """Whether ``engine`` serves a KV bootstrap port: a prefill engine of a PD deployment, or any engine
        laps runs with ``pd.role_switch`` (it may flip to prefill)."""
        if self.pd is None:
            return False
        return self.pool(engine) != "decode" or (self.pd.role_switch and engine.kind != "external")

    def bootstrap_port(self, engine: EngineConfig) -> int:
        """Where ``engine`` serves SGLang's KV bootstrap as a prefill engine (see :class:`PDConfig`).

        Raises:
            ValueError: the deployment has no ``pd:`` section.
        """
        if self.pd is None:
            raise ValueError("bootstrap ports exist only with prefill-decode disaggregation (the pd: section)")
        if engine.bootstrap_port is not None:
            return engine.bootstrap_port
        return self.pd.bootstrap_port if engine.kind == "external" else self.pd.bootstrap_port + self.engines.index(engine)

    def page_tokens(self, engine: EngineConfig, role: str | None = None) -> int:
        """``engine``'s KV page size in tokens with ``role`` (default: its configured role): the role's ``page-size``
        flag, else SGLang's default 1."""
        return int(self.roles[role or engine.role].flags.get("page-size", 1))

    def publishes_kv_events(self, engine: EngineConfig) -> bool:
        """Whether the gateway follows ``engine``'s KV cache events: ``scheduling.kv_events`` is on and laps starts the
        engine (and so adds the flag), or the engine is ``external`` with a ``kv_events_endpoint``."""
        return self.scheduling.kv_events and (engine.kind != "external" or engine.kv_events_endpoint is not None)


def _check_controller_roles(config: Config) -> None:
    """Each controller role must exist and serve its pool: both when the controller is on, else those set explicitly.

    An enabled controller's ``min_pool_size`` must be below the number of short and long engines, else
    no pool could ever give one up.

    A disabled controller that the file never mentions keeps its default role names unchecked, so a
    deployment whose roles are named otherwise still loads.
    """
    for pool in ("short", "long"):
        key, role = f"{pool}_role", config.controller.role_for(pool)
        if not config.controller.enabled and key not in config.controller.model_fields_set:
            continue
        if role not in config.roles:
            raise ValueError(f"controller.{key}: {role!r} is not a role defined under roles; allowed: {', '.join(sorted(config.roles))}")
        if config.roles[role].pool != pool:
            raise ValueError(f"controller.{key}: role {role!r} serves the {config.roles[role].pool} pool, not the {pool} pool")
    if config.controller_sizes_decode():
        role = config.controller.decode_role
        if role not in config.roles:
            raise ValueError(f"controller.decode_role: {role!r} is not a role defined under roles (the controller sizes the decode "
                             f"pool with pd.role_switch); allowed: {', '.join(sorted(config.roles))}")
        if config.roles[role].pool != "decode":
            raise ValueError(f"controller.decode_role: role {role!r} serves the {config.roles[role].pool} pool, not the decode pool")
    if config.controller.enabled:
        movable = sum(config.pool(e) in ("short", "long") for e in config.engines)
        if movable <= config.controller.min_pool_size:
            raise ValueError(f"controller.min_pool_size: {config.controller.min_pool_size} allows no move: a pool gives up an engine "
                             f"only while it has more than min_pool_size, and the short and long pools have {movable} engine(s) in all; "
                             f"set it below {movable} or disable the controller")


def _http_ports(config: Config) -> dict[int, str]:
    """The HTTP ports set in ``config`` on this machine, each with whose it is: the gateway's (unless 0, any free
    one) and those of the engines laps runs.

    Raises:
        ValueError: two of them are the same port (the second engine would not start, or would find the first
            answering in its place).
    """
    taken = {config.gateway.port: "the gateway (gateway.port)"} if config.gateway.port else {}
    for i, engine in enumerate(config.engines):
        if engine.kind == "external" or engine.port is None:
            continue
        clash = taken.get(engine.port)
        if clash is not None:
            raise ValueError(f"engines.{i}.port: port {engine.port} of {engine.name!r} is already used by {clash}; "
                             "give each engine a port of its own, or leave it out (null: a free port is picked)")
        taken[engine.port] = f"engine {engine.name!r}"
    return taken


def _check_pd(config: Config, taken: dict[int, str]) -> None:
    """PD roles and ports: a decode pool only with ``pd:``, both sides present, no hand-set PD flags, no KV bootstrap
    port on one of ``taken`` (:func:`_http_ports`) or on another engine's."""
    for name, role in config.roles.items():
        if config.pd is None and role.pool == "decode":
            raise ValueError(f"roles.{name}.pool: decode engines exist only with prefill-decode disaggregation; add the pd: section")
        for flag in PD_FLAGS:
            if flag in role.flags:
                raise ValueError(f"roles.{name}.flags.{flag}: laps sets this flag from the pd: section and the role's pool; remove it")
    if config.pd is None:
        for i, engine in enumerate(config.engines):
            if engine.bootstrap_port is not None:
                raise ValueError(f"engines.{i}.bootstrap_port: only engines of a prefill-decode deployment (the pd: section) have one")
        return
    decode = [e.name for e in config.engines if config.pool(e) == "decode"]
    prefill = [e.name for e in config.engines if config.pool(e) != "decode"]
    if not decode or not prefill:
        raise ValueError(f"pd: a prefill-decode deployment needs at least one prefill engine (pool short or long) and one decode engine (pool decode); engines has {len(prefill)} prefill and {len(decode)} decode")
    taken = dict(taken)
    for i, engine in enumerate(config.engines):
        if not config.serves_bootstrap(engine):
            if engine.bootstrap_port is not None:
                raise ValueError(f"engines.{i}.bootstrap_port: {engine.name!r} is a decode engine (role {engine.role!r}); only prefill engines serve a KV bootstrap port; remove it (or set pd.role_switch, with which every engine laps runs has one)")
            continue
        if engine.kind == "external":
            continue  # it runs elsewhere: its port cannot clash with ours
        port = config.bootstrap_port(engine)
        key = f"engines.{i}.bootstrap_port" if engine.bootstrap_port is not None else "pd.bootstrap_port"
        if port > 65535:
            raise ValueError(f"{key}: the KV bootstrap port of {engine.name!r} is pd.bootstrap_port ({config.pd.bootstrap_port}) + its index in engines ({i}) = {port}, above 65535; lower pd.bootstrap_port or set engines.{i}.bootstrap_port")
        clash = taken.get(port)
        if clash is not None:
            raise ValueError(f"{key}: port {port} (KV bootstrap of {engine.name!r}) is already used by {clash}; set engines.{i}.bootstrap_port or pd.bootstrap_port")
        taken[port] = f"engine {engine.name!r} (KV bootstrap)"


PD_PREFILL_POLICIES = ("laps", "pools", "least_load", "round_robin", "cache_aware", "bucket")
"""The ``scheduling.policy`` values that make sense with ``pd:``, where the policy places requests on prefill engines."""


def _check_scheduling(config: Config) -> None:
    """Refuse scheduling settings that would be ignored or act on the wrong engines."""
    policy = config.scheduling.policy
    if config.pd is not None and policy not in PD_PREFILL_POLICIES:
        why = ("places requests by decode context-length band; with pd: that is scheduling.decode_placement: aligned"
               if policy == "aligned" else
               "reserves each request's predicted output tokens in the chosen engine's KV pool, but with pd: the prefill engine does not decode")
        raise ValueError(f"scheduling.policy: {policy!r} {why}; with pd: the policy places requests on prefill engines: "
                         f"use one of {', '.join(PD_PREFILL_POLICIES)}")
    if config.pd is None and config.scheduling.decode_placement != "least_load":
        raise ValueError(f"scheduling.decode_placement: {config.scheduling.decode_placement!r} chooses among the decode engines "
                         "of a prefill-decode deployment and needs the pd: section; without it use scheduling.policy: aligned")


KV_EVENTS_FLAG = "kv-events-config"


def _check_kv_events(config: Config) -> None:
    """With ``scheduling.kv_events``: no role sets the flag laps sets, and, when some engine is followed, every role's
    pages divide the prefix blocks (an engine may move to any role). Without it: no engine names an endpoint nothing
    would follow."""
    if not config.scheduling.kv_events:
        for i, engine in enumerate(config.engines):
            if engine.kv_events_endpoint is not None:
                raise ValueError(f"engines.{i}.kv_events_endpoint: scheduling.kv_events is false, so nothing follows it; remove it or turn kv_events on")
        return
    for name, role in config.roles.items():
        if KV_EVENTS_FLAG in role.flags:
            raise ValueError(f"roles.{name}.flags.{KV_EVENTS_FLAG}: laps sets this flag (one endpoint per engine) while "
                             "scheduling.kv_events is on; remove it, or set scheduling.kv_events: false to manage it yourself")
    block = config.scheduling.prefix_block_tokens
    if not any(config.publishes_kv_events(e) for e in config.engines):
        return
    for name, role in config.roles.items():
        page = role.flags.get("page-size", 1)
        if not isinstance(page, int) or page < 1 or block % page:
            raise ValueError(f"roles.{name}.flags.page-size: pages of {page!r} tokens must divide scheduling.prefix_block_tokens "
                             f"({block}) for the engines' KV events to give exact prefix hits; change one, or set "
                             "scheduling.kv_events: false")


def _check_kind(i: int, engine: EngineConfig) -> None:
    if engine.kind != "external":
        if engine.url is not None:
            raise ValueError(f"engines.{i}.url: only kind external takes a url; laps starts kind {engine.kind} engines itself on 127.0.0.1 (set port instead)")
        for key in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            if getattr(engine, key) is not None:
                raise ValueError(f"engines.{i}.{key}: only kind external takes one; laps picks the KV event ports of the engines it starts")
        return
    if engine.url is None:
        raise ValueError(f"engines.{i}.url: kind external needs the engine's url (http://host:port)")
    for key in ("gpus", "port"):
        if getattr(engine, key):
            raise ValueError(f"engines.{i}.{key}: kind external takes no {key}; the engine runs elsewhere, at its url")
    if engine.kv_events_replay_endpoint is not None and engine.kv_events_endpoint is None:
        raise ValueError(f"engines.{i}.kv_events_replay_endpoint: needs kv_events_endpoint (where the engine publishes)")


def _allowed_keys(loc: tuple) -> list[str]:
    """The keys the model at ``loc`` (the parent of an unknown key) accepts; [] when it is not a model."""
    model: type[BaseModel] = Config
    dict_key_next = False
    for part in loc:
        if dict_key_next or isinstance(part, int):  # a mapping's key or a list index: same item model
            dict_key_next = False
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        annotation = field.annotation
        models = [a for a in (annotation, *get_args(annotation)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if not models:
            return []
        model = models[0]
        dict_key_next = get_origin(annotation) is dict
    return sorted(model.model_fields)


MAX_ERRORS_SHOWN = 20
_SECRETS = ("admin_key", "api_keys")
_REPR = reprlib.Repr()  # bounded (depth 2, strings of 60 characters): an aliased YAML structure may be vast
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 2, 60, 60


def _got(loc: tuple, value: Any) -> str:
    """`` (got VALUE)`` for an error at ``loc``: ``value`` cut short, and nothing of a client or admin key."""
    return "" if any(part in _SECRETS for part in loc) else f" (got {_REPR.repr(value)})"


# The key path a root validator's message starts with (``engines.1.port: ...``).
_NAMED_KEY = re.compile(r"([A-Za-z_][\w.-]*): ")


def _format_error(source: str, err: ValidationError, document: yaml.Node | None = None) -> str:
    """One line per error of ``err``, each naming its key path and, where ``document`` (the file's YAML node tree) has
    that key, its line."""
    lines = [f"{source}: invalid configuration"]
    errors = err.errors()
    for e in errors[:MAX_ERRORS_SHOWN]:
        loc = e["loc"]
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "value_error" and not loc:  # a root validator's message names its key path first
            named = _NAMED_KEY.match(msg)
            if named is None:
                lines.append(f"  {msg}")
                continue
            loc = tuple(int(p) if p.isdigit() else p for p in named.group(1).split("."))
            msg = msg[named.end():]
        elif e["type"] == "extra_forbidden":
            allowed = _allowed_keys(loc[:-1])
            msg = "unknown key" + (f"; allowed: {', '.join(allowed)}" if allowed else "")
        elif e["type"] not in ("value_error", "missing"):  # a missing key's input is its parent, the whole file at the top
            msg += _got(loc, e["input"])
        line = _line_of(document, loc)
        lines.append(f"  {'.'.join(map(str, loc))}{'' if line is None else f' (line {line})'}: {msg}")
    if len(errors) > MAX_ERRORS_SHOWN:
        lines.append(f"  ... and {len(errors) - MAX_ERRORS_SHOWN} more")
    return "\n".join(lines)


def _line_of(document: yaml.Node | None, loc: tuple) -> int | None:
    """The line (1-based) of the deepest key (or list item) of ``loc`` that ``document`` holds; ``None`` for none."""
    line, node = None, document
    for part in loc:
        if isinstance(node, yaml.MappingNode):  # the last of equal keys: a merge (``<<``) puts the merged ones first
            item = next(((k, v) for k, v in reversed(node.value) if isinstance(k, yaml.ScalarNode) and k.value == str(part)), None)
            if item is None:
                break
            line, node = item[0].start_mark.line + 1, item[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def parse_config(data: Any, source: str = "<config>", document: yaml.Node | None = None) -> Config:
    """Validate already-parsed YAML data into a :class:`Config`; ``document``: the YAML node tree ``data`` was built
    from, whose lines the errors give.

    Raises:
        ConfigError: with one line per problem, each naming the key path (and its line, with ``document``).
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, got {type(data).__name__}")
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(source, err, document)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last, silently: a second
    ``gateway:`` block would drop the first whole)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<``: merged keys may be overridden, as YAML allows
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (list, dict)):
                continue  # unhashable: SafeLoader's own construct_mapping says so
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice in one mapping",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path | None = None) -> Config:
    """Read and validate a YAML deployment file (default: the repository's ``config.yaml``).

    Raises:
        ConfigError: if the file is missing, is not valid YAML, or fails validation.
    """
    path = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read configuration: {err.strerror}") from None
    try:
        text = raw.decode()
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start}); YAML files are UTF-8") from None
    loader = _UniqueKeyLoader(text)
    try:
        document = loader.get_single_node()
        data = loader.construct_document(document) if document is not None else None
    except RecursionError:
        raise ConfigError(f"{path}: not valid YAML: nested deeper than the parser goes") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(err, 'problem', None) or err}") from None
    finally:
        loader.dispose()
    if data is None:
        raise ConfigError(f"{path}: the file holds no configuration (it is empty or only comments)")
    return parse_config(data, str(path), document)

