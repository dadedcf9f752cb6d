"""The OpenAI-compatible endpoints through the official ``openai`` client: greedy completions of a
base model and of a trained checkpoint equal the Tinker SDK's greedy samples of the same weights;
streaming yields the same text; chat goes through the tokenizer's chat template; stop strings,
``n``, seeds and logprobs behave as OpenAI documents; a bad model path or another key's checkpoint
is a 404 in OpenAI's error shape."""

import numpy as np
import openai
import tinker
from tinker import types
from transformers import AutoTokenizer

from tests.conformance.scenarios.common import CONF, QWEN3, model_dir

oai = openai.OpenAI(base_url=f"{CONF['base_url']}/oai/api/v1", api_key=CONF["keys"]["alice"])
tok = AutoTokenizer.from_pretrained(model_dir(QWEN3))
sc = tinker.ServiceClient()

# the served models
assert QWEN3 in [m.id for m in oai.models.list().data]

# a base model: greedy text equals the Tinker SDK's greedy sample of the same prompt
prompt = "The quick brown fox"
ids = tok(prompt)["input_ids"]
base = sc.create_sampling_client(base_model=QWEN3)
# the same stopping rule the endpoint uses: end of sequence or of turn (both special tokens)
greedy = types.SamplingParams(max_tokens=12, temperature=0.0, stop=[tok.eos_token, "<|im_end|>"])
want = base.sample(types.ModelInput.from_ints(ids), 1, greedy).result().sequences[0]
got = oai.completions.create(model=QWEN3, prompt=prompt, max_tokens=12, temperature=0)
assert got.choices[0].text == tok.decode(want.tokens, skip_special_tokens=True), (got, want)
assert got.usage.prompt_tokens == len(ids) and got.object == "text_completion"

# a trained checkpoint (sampler_weights): the same equality, and it differs from the base model
tc = sc.create_lora_training_client(base_model=QWEN3, rank=8, seed=1).result()
rng = np.random.default_rng(0)
for _ in range(3):
    seq = rng.integers(3, 500, 17).tolist()
    tc.forward_backward([types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                                     loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * 16})],
                        "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
path = tc.save_weights_for_sampler("oai").result().path
trained = sc.create_sampling_client(model_path=path)
want = trained.sample(types.ModelInput.from_ints(ids), 1, greedy).result().sequences[0]
got = oai.completions.create(model=path, prompt=ids, max_tokens=12, temperature=0)
text = tok.decode(want.tokens, skip_special_tokens=True)
assert got.choices[0].text == text, (got.choices[0].text, text)

# streaming yields the same text, chunk by chunk, then [DONE]
pieces = [c.choices[0].text for c in oai.completions.create(model=path, prompt=ids, max_tokens=12, temperature=0,
                                                            stream=True) if c.choices]
assert "".join(pieces) == text and len(pieces) > 1, pieces

# logprobs: the sampled tokens' own, and k alternatives each
lp = oai.completions.create(model=path, prompt=ids, max_tokens=5, temperature=0, logprobs=3).choices[0].logprobs
np.testing.assert_allclose(lp.token_logprobs, want.logprobs[: len(lp.token_logprobs)], atol=1e-4)
assert all(len(t) == 3 for t in lp.top_logprobs)

# n samples with a seed: reproducible, and a stop string ends the text before it
a = oai.completions.create(model=QWEN3, prompt=prompt, max_tokens=10, n=3, seed=7)
b = oai.completions.create(model=QWEN3, prompt=prompt, max_tokens=10, n=3, seed=7)
assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 3
full = oai.completions.create(model=QWEN3, prompt=prompt, max_tokens=20, temperature=0).choices[0].text
if len(full) > 4:
    stop = full[2:4]
    cut = oai.completions.create(model=QWEN3, prompt=prompt, max_tokens=20, temperature=0, stop=[stop]).choices[0]
    assert cut.text == full[: full.find(stop)] and cut.finish_reason == "stop", (cut, full, stop)

# chat: the chat template, the same engines; streaming gives the same message
messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a LoRA adapter?"}]
chat = oai.chat.completions.create(model=path, messages=messages, max_tokens=10, temperature=0, logprobs=True,
                                   top_logprobs=2)
chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
want = trained.sample(types.ModelInput.from_ints(chat_ids), 1, types.SamplingParams(
    max_tokens=10, temperature=0.0, stop=[tok.eos_token, "<|im_end|>"])).result().sequences[0]
expected = tok.decode(want.tokens, skip_special_tokens=True)
assert chat.choices[0].message.content == expected, (chat.choices[0].message.content, expected)
assert chat.usage.prompt_tokens == len(chat_ids) and chat.choices[0].logprobs.content[0].top_logprobs
streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
    model=path, messages=messages, max_tokens=10, temperature=0, stream=True) if c.choices)
assert streamed == chat.choices[0].message.content

# errors in OpenAI's shape: an unknown model, a bad path, another key's checkpoint, a bad key
for model in ("no-such-model", "tinker://nope:train:0/sampler_weights/x"):
    try:
        oai.completions.create(model=model, prompt="x", max_tokens=2)
        raise AssertionError(f"{model} must be a 404")
    except openai.NotFoundError as e:
        assert e.body["message"] and e.body["type"] == "invalid_request_error", e.body
bob = openai.OpenAI(base_url=f"{CONF['base_url']}/oai/api/v1", api_key=CONF["keys"]["bob"])
try:
    bob.completions.create(model=path, prompt="x", max_tokens=2)
    raise AssertionError("another key's checkpoint must be a 404")
except openai.NotFoundError:
    pass
try:
    openai.OpenAI(base_url=f"{CONF['base_url']}/oai/api/v1", api_key="tml-nope").models.list()
    raise AssertionError("a bad key must be a 401")
except openai.AuthenticationError:
    pass
try:
    oai.completions.create(model=QWEN3, prompt=["x"] * 65, max_tokens=1)
    raise AssertionError("65 prompts in one request must be refused")
except openai.BadRequestError as e:
    assert "at most 64" in e.body["message"], e.body
for bad in ({"presence_penalty": 1.0}, {"temperature": 5}, {"n": 0}):
    try:
        oai.completions.create(model=QWEN3, prompt="x", max_tokens=2, **bad)
        raise AssertionError(f"{bad} must be refused")
    except openai.BadRequestError as e:
        assert e.body["message"], e.body
sc.close("success").result()
print("openai ok")
