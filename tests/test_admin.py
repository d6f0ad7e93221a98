"""The admin API on a live gateway with simulated engine processes: auth, listing, a role switch by hand."""

from __future__ import annotations

import time

import httpx
import pytest
import yaml

from engines.manager import free_port
from laps.config import DEFAULT_CONFIG_PATH, parse_config
from tests.live_gateway import LiveGateway

KEY = "s3cret-admin-key"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    data["gateway"].update(port=free_port(), admin_key=KEY)
    data["log_dir"] = str(tmp_path_factory.mktemp("admin") / "logs")
    with LiveGateway(parse_config(data)) as gateway:
        yield gateway


def admin(live, method: str, path: str, key: str | None = KEY, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.request(method, live.url + path, headers=headers, timeout=10, **kwargs)


@pytest.mark.parametrize("key", [None, "wrong-key-123"])
def test_admin_needs_the_key(live, key):
    for method, path in (("GET", "/admin/engines"), ("POST", "/admin/engines/sp0/role")):
        resp = admin(live, method, path, key=key, json={"role": "mixed"})
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    "engine, body, status, param",
    [
        ("nope", {"role": "mixed"}, 404, "id"),
        ("sp0", {"role": "tiny"}, 400, "role"),
        ("sp0", {"role": "mixed", "drain_timeout_s": -1}, 400, "drain_timeout_s"),
    ],
)
def test_bad_role_switch_requests(live, engine, body, status, param):
    resp = admin(live, "POST", f"/admin/engines/{engine}/role", json=body)
    assert resp.status_code == status and resp.json()["error"]["param"] == param


def test_a_move_to_the_role_the_engine_has_is_200_unchanged(live):
    resp = admin(live, "POST", "/admin/engines/sp0/role", json={"role": "short-prefill"})
    assert resp.status_code == 200 and resp.json() == {"engine": "sp0", "role": "short-prefill", "status": "unchanged"}
    sp0 = next(e for e in admin(live, "GET", "/admin/engines").json()["engines"] if e["id"] == "sp0")
    assert (sp0["role"], sp0["state"]) == ("short-prefill", "healthy")


def test_list_then_move_an_engine_to_the_short_pool_by_hand(live):
    engines = {e["id"]: e for e in admin(live, "GET", "/admin/engines").json()["engines"]}
    assert {k: (e["kind"], e["role"], e["pool"], e["state"], e["gpus"]) for k, e in engines.items()} == {
        "sp0": ("sim", "short-prefill", "short", "healthy", [0]),
        "lp0": ("sim", "long-prefill", "long", "healthy", [1]),
    }
    resp = admin(live, "POST", "/admin/engines/lp0/role", json={"role": "short-prefill", "drain_timeout_s": 5})
    assert resp.status_code == 202 and resp.json() == {"engine": "lp0", "role": "short-prefill", "status": "switching"}
    assert admin(live, "POST", "/admin/engines/lp0/role", json={"role": "mixed"}).status_code == 409
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        lp0 = next(e for e in admin(live, "GET", "/admin/engines").json()["engines"] if e["id"] == "lp0")
        if lp0["state"] != "switching":
            break
        time.sleep(0.2)
    assert (lp0["role"], lp0["pool"], lp0["state"]) == ("short-prefill", "short", "healthy")


def test_admin_api_is_off_without_a_key(tmp_path):
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    data["gateway"]["port"] = free_port()
    data["log_dir"] = str(tmp_path / "logs")
    with LiveGateway(parse_config(data)) as gateway:
        resp = httpx.get(gateway.url + "/admin/engines", headers={"Authorization": "Bearer anything"}, timeout=10)
    assert resp.status_code == 403 and "gateway.admin_key" in resp.json()["error"]["message"]
