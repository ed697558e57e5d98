"""``GET /kv_event_sources`` points a router at the KV events, which carry every tenant's
prompt tokens: with API keys it needs one, and the endpoint it names comes from the settings
only, never from the request's ``Host`` header (which a client can forge)."""

from __future__ import annotations

import json
import socket

from gnosis_daemon.settings import Settings
from host.app import create_app
from host.station_link import StationLink
from host.tokenize_api import kv_event_sources


def _client(tmp_path, **settings):
    s = Settings(runtime_dir=str(tmp_path), **settings)
    return create_app(s, StationLink(s.station_socket, max_frame_bytes=s.max_frame_bytes)
                      ).test_client()


async def _get(client, headers):
    response = await client.get("/kv_event_sources", headers=headers)
    return response.status_code, json.loads(await response.get_data() or b"null")


async def test_with_keys_it_needs_one_and_ignores_a_forged_host(tmp_path):
    client = _client(tmp_path, api_keys="sk-one", kv_events_endpoint="tcp://127.0.0.1:5557",
                     kv_events_replay_endpoint="tcp://127.0.0.1:5558")
    status, body = await _get(client, {"Host": "attacker.example:80"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _ = await _get(client, {"Authorization": "Bearer sk-two"})
    assert status == 401
    status, body = await _get(client, {"Authorization": "Bearer sk-one",
                                       "Host": "attacker.example:80"})
    assert (status, body) == (200, [{"data_parallel_rank": 0,
                                     "endpoint": "tcp://127.0.0.1:5557",
                                     "replay_endpoint": "tcp://127.0.0.1:5558", "topic": ""}])


async def test_a_wildcard_bind_is_advertised_by_the_configured_name(tmp_path):
    # No keys: the open single-user daemon may bind a wildcard.
    client = _client(tmp_path, kv_events_endpoint="tcp://*:5557",
                     kv_events_advertise_host="gnosis-daemon-0.gnosis-daemon")
    status, body = await _get(client, {"Host": "attacker.example"})
    assert status == 200
    assert body[0]["endpoint"] == "tcp://gnosis-daemon-0.gnosis-daemon:5557"
    assert body[0]["replay_endpoint"] is None
    # Without a configured name: this machine's own host name, whatever the request says.
    client = _client(tmp_path, kv_events_endpoint="tcp://0.0.0.0:5557")
    status, body = await _get(client, {"Host": "attacker.example"})
    assert body[0]["endpoint"] == f"tcp://{socket.gethostname()}:5557"


def test_events_off_is_an_empty_list():
    assert kv_event_sources("", "", "name") == []
