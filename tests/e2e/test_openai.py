"""The OpenAI client against a fleet of real llama-server nodes."""

import openai
import pytest
from openai import OpenAI

import sdk_helpers
from harness import wait_until


@pytest.fixture(scope="module")
def client(fleet):
    return OpenAI(base_url=f"{fleet.url}/v1", api_key=fleet.api_key, max_retries=0, timeout=60)


def ask(text):
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


def test_models_list_and_retrieve(client):
    ids = sorted(model.id for model in client.models.list())
    assert ids == ["tiny-chat", "tiny-embed"]
    assert client.models.retrieve("tiny-chat").id == "tiny-chat"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_runs_to_max_tokens_and_is_deterministic(client):
    first = client.chat.completions.create(model="tiny-chat", messages=ask("tell me a story"),
                                           max_tokens=12, temperature=0)
    second = client.chat.completions.create(model="tiny-chat", messages=ask("tell me a story"),
                                            max_tokens=12, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert first.usage.completion_tokens == 12
    assert first.usage.prompt_tokens > 5
    assert second.choices[0].message.content == choice.message.content


def test_a_logit_bias_on_end_of_sequence_stops_the_reply(client):
    # </s> is token 2 in the generated vocabulary.
    reply = client.chat.completions.create(model="tiny-chat", messages=ask("hi"), max_tokens=12,
                                           temperature=0, logit_bias={"2": 100})
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens < 12


def test_streaming_chat_with_and_without_usage(client):
    stream = client.chat.completions.create(model="tiny-chat", messages=ask("count"), max_tokens=10,
                                            temperature=0, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"

    stream = client.chat.completions.create(model="tiny-chat", messages=ask("count"), max_tokens=10,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 10
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text, "greedy decoding gives the same reply streamed or not"


def test_every_sdk_streaming_helper(fleet):
    # The tiny model's template offers no tools: the calls are checked on
    # the real model's fleet and the quickstart's.
    sdk_helpers.check(fleet.url, "tiny-chat", fleet.api_key, calls=False)


def test_completions(client):
    reply = client.completions.create(model="tiny-chat", prompt="once upon a time", max_tokens=6, temperature=0)
    assert reply.choices[0].text
    assert reply.usage.completion_tokens == 6
    assert reply.choices[0].finish_reason == "length"


def test_embeddings(client):
    reply = client.embeddings.create(model="tiny-embed", input=["hello world", "the story"])
    assert [d.index for d in reply.data] == [0, 1]
    vectors = [d.embedding for d in reply.data]
    assert len(vectors[0]) == 64
    assert vectors[0] != vectors[1]
    norm = sum(x * x for x in vectors[0]) ** 0.5
    assert abs(norm - 1.0) < 1e-3, "llama-server normalises embeddings"


def test_errors_are_the_ones_the_openai_client_expects(client):
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-9", messages=ask("hi"), max_tokens=4)
    assert unknown.value.code == "model_not_found"

    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-chat", messages="not a list", max_tokens=4)

    # llama-server's own error (an integer code, no param) comes back in
    # OpenAI's shape: the prompt does not fit a slot's 512-token window.
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model="tiny-chat", messages=ask("hello " * 800), max_tokens=4)
    assert too_long.value.code == "context_length_exceeded"
    assert "context" in too_long.value.message


def test_the_gateway_names_the_node_and_the_request(client):
    raw = client.chat.completions.with_raw_response.create(model="tiny-chat", messages=ask("hi"), max_tokens=2)
    assert raw.headers["x-inferyes-node"] in ("node-a", "node-b")
    assert raw.headers["x-request-id"]
    assert raw.headers["x-inferyes-route"] in ("placed", "resident", "warm")


def test_keys_are_checked_and_limited_to_their_models(fleet):
    with pytest.raises(openai.AuthenticationError) as refused:
        OpenAI(base_url=f"{fleet.url}/v1", api_key="ify_wrong", max_retries=0).models.list()
    assert refused.value.code == "invalid_api_key"
    created = fleet.ctl("keys", "create", "embed-only", "--model", "tiny-embed")
    narrow = OpenAI(base_url=f"{fleet.url}/v1", api_key=created["secret"], max_retries=0)
    # The key reaches the data plane with the next snapshot.
    wait_until("the new key is known", lambda: [m.id for m in narrow.models.list()] == ["tiny-embed"])
    assert narrow.embeddings.create(model="tiny-embed", input="hello").data
    with pytest.raises(openai.NotFoundError):
        narrow.chat.completions.create(model="tiny-chat", messages=ask("hi"), max_tokens=2)



def test_embeddings_are_billed_what_the_server_counted(fleet):
    created = fleet.ctl("keys", "create", "embedder")
    embedder = OpenAI(base_url=f"{fleet.url}/v1", api_key=created["secret"], max_retries=0, timeout=60)
    wait_until("the new key is known", lambda: [m.id for m in embedder.models.list()])
    # Vectors enough that the answer's last kilobytes hold no usage: the
    # server writes it before them.
    reply = embedder.embeddings.create(model="tiny-embed", input=[f"text number {i}" for i in range(16)],
                                       encoding_format="float")
    assert len(reply.data) == 16 and reply.usage.prompt_tokens > 16

    def billed():
        rows = fleet.ctl("usage", "--key", created["key_id"])["rows"]
        return rows[0] if rows and rows[0]["requests"] == 1 else None

    usage = wait_until("the embeddings billed", billed)
    assert (usage["prompt_tokens"], usage["estimated_requests"]) == (reply.usage.prompt_tokens, 0), usage


def test_a_stream_cut_after_its_first_token_is_billed_for_the_prompt_the_server_read(fleet):
    created = fleet.ctl("keys", "create", "cut-stream")
    key_id = created["key_id"]
    cut = OpenAI(base_url=f"{fleet.url}/v1", api_key=created["secret"], max_retries=0, timeout=60)
    wait_until("the new key is known", lambda: [m.id for m in cut.models.list()])
    # Dense text, about a token a byte: a fifth of what the server reads,
    # were the body's size the measure.
    messages = ask(",".join(f"{i:x}" for i in range(150, 250)))
    stream = cut.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=300, stream=True)
    for chunk in stream:
        assert "prompt_progress" not in chunk.model_dump_json(), "the gateway's own request reached the client"
        if chunk.choices and chunk.choices[0].delta.content:
            break
    stream.close()

    # What the server reads of that prompt, as it counts it.
    direct = OpenAI(base_url=f"{fleet.llama['node-a']}/v1", api_key="unused", max_retries=0)
    read = direct.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=1).usage.prompt_tokens

    def billed():
        rows = fleet.ctl("usage", "--key", key_id)["rows"]
        return rows[0] if rows and rows[0]["requests"] == 1 else None

    wait_until("the cut stream is billed", billed)
    usage = billed()
    assert usage["errors"] == 1, f"not cut short: {usage}"
    assert usage["estimated_requests"] == 0, usage
    assert usage["prompt_tokens"] >= 0.95 * read, f"billed {usage} of the {read} tokens read"
