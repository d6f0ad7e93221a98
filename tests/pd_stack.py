"""A prefill–decode deployment for tests: the shipped config with PD roles, two prefill and two decode engines."""

from __future__ import annotations

import copy

import yaml

from engines.manager import FREE_PORT_RANGE, free_port, port_free
from laps.config import DEFAULT_CONFIG_PATH, Config, parse_config

PD_ROLES = {
    "prefill-short": {"pool": "short", "flags": {"chunked-prefill-size": 2048}},
    "prefill-long": {"pool": "long", "flags": {"chunked-prefill-size": 16384}},
    "decode": {"pool": "decode", "flags": {"max-running-requests": 256}},
}
PD_ENGINES = [
    {"name": "ps0", "kind": "sim", "role": "prefill-short", "gpus": [0]},
    {"name": "pl0", "kind": "sim", "role": "prefill-long", "gpus": [1]},
    {"name": "d0", "kind": "sim", "role": "decode", "gpus": [2]},
    {"name": "d1", "kind": "sim", "role": "decode", "gpus": [3]},
]


def free_bootstrap_base(engines: int = len(PD_ENGINES)) -> int:
    """A ``pd.bootstrap_port`` whose ``engines`` ports from it (engine ``i`` serves KV on the base plus ``i``) were all
    free a moment ago, below the ephemeral range; with ``pd.role_switch`` the decode engines bind theirs too.

    Raises:
        OSError: no such run of ports in 100 tries.
    """
    for _ in range(100):
        base = free_port()
        if base + engines - 1 <= FREE_PORT_RANGE[1] and all(port_free(base + i) for i in range(1, engines)):
            return base
    raise OSError(f"no {engines} consecutive free TCP ports in {FREE_PORT_RANGE[0]}-{FREE_PORT_RANGE[1]}")


def pd_data(**top) -> dict:
    """The shipped config.yaml's data with ``pd:`` on, the PD roles added and the four PD engines; ``top`` overrides keys."""
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    data["roles"] = {**data["roles"], **copy.deepcopy(PD_ROLES)}
    data.update({"pd": {"transfer_backend": "mooncake", "bootstrap_port": 8998}, "engines": copy.deepcopy(PD_ENGINES), **top})
    return data


def pd_config(**top) -> Config:
    """:func:`pd_data` validated."""
    return parse_config(pd_data(**top))
