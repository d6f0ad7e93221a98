"""Client API keys, the Bearer scheme for client and admin keys, and the media type of request bodies."""

from __future__ import annotations

import logging

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from gateway.app import create_app
from laps.api_keys import key_digest, parse_key_file
from laps.config import ConfigError, load_config
from tests.fake_engine import FakeEngine
from tests.test_gateway import ADMIN_KEY, chat, with_gateway

KEYS = ["sk-laps-client-one", "sk-laps-client-two"]


async def gateway_with(tmp_path, **gateway):
    """A gateway with ``gateway`` keys in front of two fake engines; (session, fakes, servers)."""
    fakes = {"sp0": FakeEngine("sp0"), "lp0": FakeEngine("lp0")}
    servers = {name: TestServer(f.app) for name, f in fakes.items()}
    for s in servers.values():
        await s.start_server()
    urls = {name: str(s.make_url("")).rstrip("/") for name, s in servers.items()}
    server = TestServer(create_app(with_gateway(load_config(), **gateway), engine_urls=urls), handler_cancellation=True)
    await server.start_server()
    return server, servers


@pytest.fixture
async def keyed(tmp_path):
    server, servers = await gateway_with(tmp_path, api_keys=KEYS, admin_key=ADMIN_KEY)
    async with aiohttp.ClientSession(str(server.make_url(""))) as session:
        yield session
    await server.close()
    for s in servers.values():
        await s.close()


@pytest.mark.parametrize("header, code, message", [
    (None, None, "You didn't provide an API key"),
    ("Bearer sk-wrong-key-000", "invalid_api_key", "Incorrect API key provided: sk-...-000."),
    (f"Basic {KEYS[0]}", None, "You didn't provide an API key"),  # only the Bearer scheme
    (KEYS[0], None, "You didn't provide an API key"),  # a bare key is no Bearer key
])
async def test_the_v1_api_refuses_requests_without_a_client_key_with_openai_401(keyed, header, code, message):
    headers = {} if header is None else {"Authorization": header}
    for method, path, payload in (("POST", "/v1/chat/completions", chat("Hi")), ("GET", "/v1/models", None)):
        async with keyed.request(method, path, json=payload, headers=headers) as resp:
            assert resp.status == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
            error = (await resp.json())["error"]
        assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, None)
        assert error["message"].startswith(message) and KEYS[0] not in error["message"]
    async with keyed.get("/metrics") as resp:  # a refused client shows (its key does not)
        text = await resp.text()
    assert f'laps_requests_total{{cls="unplaced",outcome="{code or "http_401"}"}} 2.0' in text and KEYS[0] not in text


async def test_client_keys_are_taken_in_any_case_of_bearer_and_counted_per_key(keyed):
    for scheme, key in (("Bearer", KEYS[0]), ("bearer", KEYS[0]), ("BEARER", KEYS[1])):
        async with keyed.post("/v1/chat/completions", json=chat("Hi"), headers={"Authorization": f"{scheme} {key}"}) as resp:
            assert resp.status == 200
    async with keyed.get("/metrics") as resp:  # /metrics and /health need no client key
        text = await resp.text()
    assert f'laps_api_key_requests_total{{key="key-{key_digest(KEYS[0])[:8]}"}} 2.0' in text
    assert f'laps_api_key_requests_total{{key="key-{key_digest(KEYS[1])[:8]}"}} 1.0' in text
    assert KEYS[0] not in text


async def test_the_admin_key_takes_bearer_in_any_case_and_nothing_else(keyed):
    for header, status in ((f"bearer {ADMIN_KEY}", 200), (f"Bearer {ADMIN_KEY}", 200), (ADMIN_KEY, 401), (f"Token {ADMIN_KEY}", 401)):
        async with keyed.get("/admin/engines", headers={"Authorization": header}) as resp:
            assert resp.status == status, header


async def test_a_key_file_holds_digests_and_labels(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text(f"# laps client keys\n\nsha256:{key_digest('sk-team-a-0001')} team-a\n{key_digest('sk-team-b-0002')}  -\n")
    assert parse_key_file(path.read_text(), str(path)) == {key_digest("sk-team-a-0001"): "team-a",
                                                          key_digest("sk-team-b-0002"): f"key-{key_digest('sk-team-b-0002')[:8]}"}
    server, servers = await gateway_with(tmp_path, api_keys=str(path))
    async with aiohttp.ClientSession(str(server.make_url(""))) as session:
        async with session.post("/v1/chat/completions", json=chat("Hi"), headers={"Authorization": "Bearer sk-team-a-0001"}) as resp:
            assert resp.status == 200
        async with session.post("/v1/chat/completions", json=chat("Hi"), headers={"Authorization": f"Bearer {key_digest('sk-team-a-0001')}"}) as resp:
            assert resp.status == 401  # the digest is not the key
        async with session.get("/metrics") as resp:
            assert 'laps_api_key_requests_total{key="team-a"} 1.0' in await resp.text()
    await server.close()
    for s in servers.values():
        await s.close()


@pytest.mark.parametrize("keys, fragment", [
    ("/nonexistent/keys.txt", "cannot read the API key file"),
    ([], "an empty list lets nobody in"),
    (["short"], "at least 8 characters"),
])
def test_bad_api_keys_fail_at_load(keys, fragment):
    with pytest.raises(ConfigError, match=fragment):
        with_gateway(load_config(), api_keys=keys)


def test_key_file_comments_after_a_key_are_skipped_as_in_the_readme_example():
    text = ("# keys.txt: [sha256:]<hex digest> [label]\n   \n"
            "sha256:0c55d73decea73c6807948b6fc35a5f7c446ea3a8400224532c1249fe73587a9 team-a   # the key sk-team-a-example\n"
            f"{key_digest('sk-team-b-0002')}# no space before the '#': not a comment\n")
    with pytest.raises(ValueError, match="keys.txt line 4: expected"):
        parse_key_file(text, "keys.txt")
    assert parse_key_file(text.rsplit("\n", 2)[0] + f"\n{key_digest('sk-team-b-0002')} team#b #b\n", "keys.txt") == {
        "0c55d73decea73c6807948b6fc35a5f7c446ea3a8400224532c1249fe73587a9": "team-a", key_digest("sk-team-b-0002"): "team#b"}
    assert key_digest("sk-team-a-example") == "0c55d73decea73c6807948b6fc35a5f7c446ea3a8400224532c1249fe73587a9"


def test_short_keys_are_named_by_position_without_union_noise():
    with pytest.raises(ConfigError) as info:
        with_gateway(load_config(), api_keys=["sk-good-and-long", "sk-two"])
    assert str(info.value) == "<config>: invalid configuration\n  gateway.api_keys: key 1 is 6 characters; client keys must be at least 8 characters"


def test_a_key_file_of_plain_keys_is_refused(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("sk-plain-key-not-hashed\n")
    with pytest.raises(ConfigError, match="line 1: expected"):
        with_gateway(load_config(), api_keys=str(path))


async def test_a_gateway_open_to_the_network_without_keys_warns_at_start(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "laps.gateway")
    server, servers = await gateway_with(tmp_path, host="0.0.0.0")
    await server.close()
    for s in servers.values():
        await s.close()
    assert any("gateway.api_keys is not set" in r.getMessage() for r in caplog.records)


async def test_a_body_that_is_not_declared_json_gets_415(keyed):
    headers = {"Authorization": f"Bearer {KEYS[0]}", "Content-Type": "text/plain"}
    async with keyed.post("/v1/chat/completions", data=b'{"model": "x", "messages": []}', headers=headers) as resp:
        assert resp.status == 415
        error = (await resp.json())["error"]
    assert error == {"message": "Content-Type must be application/json, got 'text/plain'", "type": "invalid_request_error",
                     "param": "Content-Type", "code": "unsupported_media_type"}
    # No header at all: said so (aiohttp reads it as application/octet-stream, which the client never sent).
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    async with keyed.post("/v1/chat/completions", data=b'{"model": "x", "messages": []}', headers=headers,
                          skip_auto_headers=["Content-Type"]) as resp:
        assert resp.status == 415
        assert (await resp.json())["error"]["message"] == "Content-Type must be application/json, got no Content-Type header"
