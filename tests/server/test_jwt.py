"""JWT auth (client flag ``pjwt_auth_enabled``): ``POST /auth/token`` exchanges a key for a JWT that
then authenticates as the key's owner; expired, forged or malformed tokens get 401 with
``WWW-Authenticate: Bearer error="invalid_token"`` (the SDK's cue to fetch a new one); a revoked
key's tokens stop working; ``--no-auth`` servers accept only their own local owner's tokens. And the
key endpoints of ``tinker auth login/logout``: GET/DELETE /auth/apikey/me."""

import time

import jwt
import pytest

from ember.store.repo import NO_AUTH_OWNER
from tests.server.test_api import api_env, env, h  # noqa: F401 - env is a fixture


def _token(client, key) -> str:
    r = client.post("/api/v1/auth/token", json={}, headers=h(key))
    assert r.status_code == 200, r.text
    return r.json()["jwt"]


def _session(client, credential) -> str:
    r = client.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}}, headers=h(credential))
    assert r.status_code == 200, r.text
    return r.json()["session_id"]


def _invalid_token(r) -> bool:
    return r.status_code == 401 and r.json()["detail"] and \
        r.headers.get("www-authenticate") == 'Bearer error="invalid_token"'


def test_a_jwt_authenticates_as_its_keys_owner(env):  # noqa: F811
    client, store, (alice, bob) = env
    token = _token(client, alice)
    claims = jwt.decode(token, options={"verify_signature": False})
    assert claims["sub"] == store.owner_of_key(alice) and claims["org_id"] == "ember"
    assert claims["exp"] - claims["iat"] == 3600 and claims["iss"] == "ember"
    session = _session(client, token)
    assert client.get(f"/api/v1/sessions/{session}", headers=h(alice)).status_code == 200  # Alice's session
    assert client.get(f"/api/v1/sessions/{session}", headers=h(bob)).status_code == 404
    assert client.get(f"/api/v1/sessions/{session}", headers=h(_token(client, bob))).status_code == 404
    assert _token(client, token)  # a token can be renewed with itself
    # The hot routes authenticate the same way.
    r = client.post("/api/v1/retrieve_future", json={"request_id": "nope"}, headers=h(token))
    assert r.status_code == 404 and r.json()["detail"]


def test_bad_tokens_get_401_invalid_token(env):  # noqa: F811
    client, store, (alice, _) = env
    auth = client.app.state.ember.auth
    owner = store.owner_of_key(alice)
    now = int(time.time())
    expired = jwt.encode({"iss": "ember", "sub": owner, "iat": now - 100, "exp": now - 10}, auth.jwt_secret)
    forged = jwt.encode({"iss": "ember", "sub": owner, "iat": now, "exp": now + 60}, "x" * 64)
    foreign = jwt.encode({"iss": "elsewhere", "sub": owner, "iat": now, "exp": now + 60}, auth.jwt_secret)
    no_exp = jwt.encode({"iss": "ember", "sub": owner, "iat": now}, auth.jwt_secret)
    for bad in (expired, forged, foreign, no_exp, "a.b.c"):
        for r in (client.post("/api/v1/create_session", json={"tags": []}, headers=h(bad)),
                  client.post("/api/v1/optim_step", json={"model_id": "m", "seq_id": 1}, headers=h(bad))):
            assert _invalid_token(r), (bad, r.status_code, r.headers, r.text)


def test_a_revoked_keys_tokens_stop_working(env):  # noqa: F811
    client, store, (_, bob) = env
    token = _token(client, bob)
    assert store.revoke_api_key(store.owner_of_key(bob))
    r = client.post("/api/v1/create_session", json={"tags": []}, headers=h(token))
    assert r.status_code == 401 and "revoked" in r.json()["detail"], r.text


@pytest.fixture
def no_auth_client(tmp_path):
    with api_env(tmp_path, auth=False) as (client, _, _):
        yield client


def test_no_auth_servers_accept_their_own_tokens_only(no_auth_client):
    client = no_auth_client
    token = _token(client, "tml-anything")
    assert jwt.decode(token, options={"verify_signature": False})["sub"] == NO_AUTH_OWNER
    _session(client, token)
    now = int(time.time())
    other = jwt.encode({"iss": "ember", "sub": "key-123", "iat": now, "exp": now + 60},
                       client.app.state.ember.auth.jwt_secret)
    assert _invalid_token(client.post("/api/v1/create_session", json={"tags": []}, headers=h(other)))


def test_the_auth_cli_checks_and_revokes_its_own_key(env):  # noqa: F811
    """``tinker auth login/logout`` (its own client, TinkerAuthApi) against GET/DELETE /auth/apikey/me."""
    from tinker.cli.auth_api import AuthApiError, TinkerAuthApi

    client, store, (alice, bob) = env
    api = TinkerAuthApi(client, base_url=str(client.base_url))
    me = api.get_self_api_key(alice)
    key_id = store.owner_of_key(alice)
    assert me.key_id == int(key_id.removeprefix("key-"), 16) and me.name == "alice"
    assert me.details.org_details.name == "ember"
    with pytest.raises(AuthApiError, match="401"):
        api.get_self_api_key("tml-not-a-key")
    r = client.get("/api/v1/auth/apikey/me", headers=h(_token(client, alice)))
    assert r.status_code == 400 and "API key itself" in r.json()["detail"]
    api.delete_self_api_key(alice)  # revokes Alice's key only, at once
    assert client.post("/api/v1/create_session", json={"tags": []}, headers=h(alice)).status_code == 401
    assert api.get_self_api_key(bob).name == "bob"


def test_no_auth_servers_have_no_key_to_show(no_auth_client):
    r = no_auth_client.get("/api/v1/auth/apikey/me", headers=h("tml-anything"))
    assert r.status_code == 400 and "--no-auth" in r.json()["detail"]
