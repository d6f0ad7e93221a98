"""The deployment configuration: one YAML file loaded into pydantic models.

Loading runs in three stages: parse YAML -> fill defaults -> validate. Any
failure raises :class:`ConfigError` whose message names the file, the key path
(``engines.1.role``), the offending value and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from policies.laps import LapsConfig

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "config.yaml"

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

    name: str = "Qwen2.5-7B-Instruct"
    path: Path | None = None


class GatewayConfig(_Strict):
    """Where the gateway listens and how long it waits for an engine."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    request_timeout_s: float = Field(600.0, gt=0)


class SLOConfig(_Strict):
    """Service-level objectives; ``ttft_s`` is the time-to-first-token target in seconds."""

    ttft_s: float = Field(0.4, gt=0)


class CostModelConfig(_Strict):
    """Fitted prefill cost model T(L,H) = α·L(L+2H) + β·L + γw·L + γr·H, seconds (DESIGN §2.3)."""

    alpha: float = Field(gt=0)
    beta: float = Field(ge=0)
    gamma_w: float = Field(ge=0)
    gamma_r: float = Field(ge=0)


class SchedulingConfig(_Strict):
    """Length-aware scheduling parameters.

    ``short_threshold_tokens``: a request whose new (uncached) prompt tokens are
    fewer than this is a short prefill; the LAPS fallback boundary is 256.
    ``cost_model``: when set, the boundary is L_m(H) of this fitted model instead.
    ``prefix_block_tokens``: block size of the gateway's prefix-cache estimate.
    ``policy``: the scheduler (``laps``: AWD windows and gated long prefills;
    ``immediate``: dispatch at once to the least-loaded engine of the pool);
    ``laps``: its parameters.
    """

    policy: Literal["laps", "immediate"] = "laps"
    laps: LapsConfig = LapsConfig()
    short_threshold_tokens: int = Field(256, ge=1)
    cost_model: CostModelConfig | None = None
    prefix_block_tokens: int = Field(16, ge=1)


class RoleConfig(_Strict):
    """A named set of engine flags, spelled as SGLang spells them without ``--``.

    ``pool`` says which request class the role serves.
    """

    pool: Literal["short", "long"]
    flags: dict[str, FlagValue] = Field(default_factory=dict)


class SimConfig(_Strict):
    """Hardware the simulated engines model: a model preset and a GPU preset."""

    model: Literal["qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b"] = "qwen2.5-7b"
    gpu: Literal["h200", "h100", "a100"] = "h200"


class EngineConfig(_Strict):
    """One engine process.

    ``kind: sim`` runs the simulated SGLang-compatible engine. ``port: null``
    picks a free loopback port at start.
    """

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    kind: Literal["sim"] = "sim"
    role: str
    gpus: list[int] = Field(default_factory=list)
    port: int | None = Field(None, ge=1, le=65535)


class Config(_Strict):
    """The whole deployment (the root of ``config.yaml``)."""

    model: ModelConfig = ModelConfig()
    gateway: GatewayConfig = GatewayConfig()
    slo: SLOConfig = SLOConfig()
    scheduling: SchedulingConfig = SchedulingConfig()
    sim: SimConfig = SimConfig()
    roles: dict[str, RoleConfig]
    engines: list[EngineConfig] = Field(min_length=1)
    log_dir: Path = Path("runs/logs")

    @model_validator(mode="after")
    def _check_references(self) -> "Config":
        seen: set[str] = set()
        for i, engine in enumerate(self.engines):
            if engine.role not in self.roles:
                allowed = ", ".join(sorted(self.roles))
                raise ValueError(f"engines.{i}.role: {engine.role!r} is not a role defined under roles; allowed: {allowed}")
            if engine.name in seen:
                raise ValueError(f"engines.{i}.name: {engine.name!r} is used by more than one engine")
            seen.add(engine.name)
        return self

    def pool(self, engine: EngineConfig) -> str:
        """The request class (``"short"`` or ``"long"``) that ``engine``'s role serves."""
        return self.roles[engine.role].pool


def _format_error(source: str, err: ValidationError) -> str:
    lines = [f"{source}: invalid configuration"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(root)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "value_error":
            lines.append(f"  {msg}")
        else:
            lines.append(f"  {loc}: {msg} (got {e['input']!r})")
    return "\n".join(lines)


def parse_config(data: Any, source: str = "<config>") -> Config:
    """Validate already-parsed YAML data into a :class:`Config`.

    Raises:
        ConfigError: with one line per problem, each naming the key path.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, got {type(data).__name__}")
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(source, err)) from None


def load_config(path: str | Path | None = None) -> Config:
    """Read and validate a YAML deployment file (default: the repository's ``config.yaml``).

    Raises:
        ConfigError: if the file is missing, is not valid YAML, or fails validation.
    """
    path = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read configuration: {err.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    return parse_config(data, str(path))
