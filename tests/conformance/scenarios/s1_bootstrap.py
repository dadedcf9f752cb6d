"""Stage 1: RestClient bootstrap (client/config, capabilities); bad keys fail as the SDK defines."""

import os

import tinker

from tests.conformance.scenarios.common import CONF, MOE, QWEN3

rc = tinker.ServiceClient().create_rest_client()
caps = rc.get_server_capabilities().result()
names = {m.model_name: m for m in caps.supported_models}
assert set(names) == {QWEN3, MOE}, names
assert names[QWEN3].max_context_length == 1024 and names[QWEN3].trainable

# A key without the tml- prefix is refused by the SDK itself.
try:
    tinker.ServiceClient(api_key="sk-nope").create_rest_client()
    raise AssertionError("a key without tml- must be refused client-side")
except tinker.TinkerError as e:
    assert "tml-" in str(e)

# An unknown key: the server answers 401, which surfaces as AuthenticationError.
try:
    tinker.ServiceClient(api_key="tml-unknown-key", base_url=os.environ["TINKER_BASE_URL"]).create_rest_client()
    rc_bad = tinker.ServiceClient(api_key="tml-unknown-key").create_rest_client()
    rc_bad.get_server_capabilities().result()
    raise AssertionError("an unknown key must be rejected")
except tinker.AuthenticationError as e:
    assert "invalid API key" in str(e), e
assert CONF["keys"]["alice"].startswith("tml-")
print("stage 1 ok")
