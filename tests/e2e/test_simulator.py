"""The simulator held to the server it stands in for: the same requests to a
real llama-server and to `inferyes-agent simulate`, on every API both serve
(chat, completions, the Messages API and its token count, the Responses
API), whole and streamed, answer in the same shapes: the same status, the
same keys with values of the same types, the same events in the same order,
and usage that adds up the same way."""

import json
import urllib.error
import urllib.request

from harness import free_port, http_get, wait_until


def post(url, path, body):
    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def shape(value):
    """What a JSON value is made of: its keys, and its values' types."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return "null" if value is None else "str"


def events(text):
    """A stream as (event name, its data's shape), in order."""
    out = []
    for event in filter(str.strip, text.split("\n\n")):
        fields = dict(line.split(": ", 1) for line in event.split("\n"))
        data = fields["data"]
        out.append((fields.get("event"), data if data == "[DONE]" else shape(json.loads(data))))
    return out


def simulator(fleet, model):
    """A simulated llama-server of `model` beside `fleet`'s: its URL."""
    port = free_port()
    fleet.spawn(f"simulator-{model}", [str(fleet.bin / "inferyes-agent"), "simulate", "--listen",
                                       f"127.0.0.1:{port}", "--model", model])
    url = f"http://127.0.0.1:{port}"
    wait_until("the simulator healthy", lambda: http_get(f"{url}/health")[0] == 200)
    return url


def plain(answer):
    return answer.isascii() and answer.replace(" ", "").isalpha()


def plain_prompt(url):
    """A prompt the tiny model answers, greedily, in plain words, as a
    completion and as a chat: llama-server holds back a stream's opening
    events while its first token is part of a character, which the
    simulator, whose tokens are words, never does."""
    for i in range(200):
        prompt = f"tell me a story number {i}"
        _, completion = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "temperature": 0})
        _, chat = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                                      "max_tokens": 3, "temperature": 0})
        if plain(json.loads(completion)["choices"][0]["text"]) and plain(
                json.loads(chat)["choices"][0]["message"]["content"]):
            return prompt
    raise AssertionError("no prompt of 200 gets plain answers from the tiny model")


def test_the_simulator_answers_every_api_in_the_real_server_s_shapes(fleet):
    real = fleet.llama["node-a"]
    sim = simulator(fleet, "tiny-chat")
    prompt = plain_prompt(real)
    said = [{"role": "user", "content": prompt}]
    common = {"model": "tiny-chat", "temperature": 0}
    cases = [
        ("/v1/chat/completions", {**common, "max_tokens": 3, "messages": said}),
        ("/v1/chat/completions", {**common, "max_tokens": 3, "messages": said, "stream": True}),
        ("/v1/chat/completions", {**common, "max_tokens": 3, "messages": said, "stream": True,
                                  "stream_options": {"include_usage": True}}),
        ("/v1/completions", {**common, "max_tokens": 3, "prompt": prompt}),
        ("/v1/completions", {**common, "max_tokens": 3, "prompt": prompt, "stream": True}),
        ("/v1/messages", {**common, "max_tokens": 3, "system": "be brief", "messages": said}),
        ("/v1/messages", {**common, "max_tokens": 3, "messages": said, "stream": True}),
        ("/v1/messages/count_tokens", {**common, "messages": said}),
        ("/v1/responses", {**common, "max_output_tokens": 3, "instructions": "be brief", "input": prompt}),
        ("/v1/responses", {**common, "max_output_tokens": 3, "input": said, "stream": True}),
        # Errors, in llama-server's envelope and with its statuses.
        ("/v1/messages", {**common, "max_tokens": 3}),
        ("/v1/responses", {**common, "input": 5}),
        ("/v1/chat/completions", {**common}),
    ]
    for path, body in cases:
        answers = {}
        for name, url in (("real", real), ("simulated", sim)):
            status, text = post(url, path, body)
            answers[name] = (status, events(text) if body.get("stream") else shape(json.loads(text)))
        assert answers["simulated"] == answers["real"], f"{path} {json.dumps(body)}"

    # Usage adds up as the real server's does: a Messages answer's input and
    # cache reads are the prompt its token count says; a Responses answer's
    # input is the whole prompt, its cached part said apart.
    for url in (real, sim):
        _, counted = post(url, "/v1/messages/count_tokens", {**common, "messages": said})
        _, message = post(url, "/v1/messages", {**common, "max_tokens": 3, "messages": said})
        usage = json.loads(message)["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == json.loads(counted)["input_tokens"], url
        _, response = post(url, "/v1/responses", {**common, "max_output_tokens": 3, "input": said})
        usage = json.loads(response)["usage"]
        assert usage["input_tokens"] == json.loads(counted)["input_tokens"], url
        assert usage["input_tokens_details"]["cached_tokens"] > 0, url
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] == usage["input_tokens"] + 3


def runs(stream):
    """A stream's events with each run of like events taken once: a model
    writes as many deltas as it writes pieces."""
    return [event for i, event in enumerate(stream) if i == 0 or event != stream[i - 1]]


def test_the_simulator_makes_a_required_tool_call_in_the_real_server_s_shapes(gemma):
    # The real model under deploy/local/gemma.jinja, which offers tools in
    # the Hermes form llama-server parses: at temperature 0 it writes a few
    # words, then the call, and the stop sequence ends it there.
    real = gemma.llama["node-a"]
    sim = simulator(gemma, "gemma")
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    # Told to: a tool choice does not hold the real model to a call.
    said = [{"role": "system", "content": "Answer by calling a tool."},
            {"role": "user", "content": "What is the weather in Paris?"}]
    common = {"model": "gemma", "temperature": 0}
    chat = {**common, "max_tokens": 64, "messages": said, "stop": ["</tool_call>"],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]}
    messages = {**common, "max_tokens": 64, "system": said[0]["content"], "messages": said[1:],
                "stop_sequences": ["</tool_call>"],
                "tool_choice": {"type": "tool", "name": "get_weather"},
                "tools": [{"name": "get_weather", "input_schema": schema}]}
    responses = {**common, "max_output_tokens": 64, "input": said, "stop": ["</tool_call>"],
                 "tool_choice": {"type": "function", "name": "get_weather"},
                 "tools": [{"type": "function", "name": "get_weather", "parameters": schema}]}
    cases = [("/v1/chat/completions", chat), ("/v1/messages", messages), ("/v1/responses", responses)]
    for path, body in cases + [(path, {**body, "stream": True}) for path, body in cases]:
        answers = {}
        for name, url in (("real", real), ("simulated", sim)):
            status, text = post(url, path, body)
            assert '"get_weather"' in text, (name, path, text)
            answers[name] = (status, runs(events(text)) if body.get("stream") else shape(json.loads(text)),
                             ended(text))
        assert answers["simulated"] == answers["real"], f"{path} {json.dumps(body)}"


def ended(text):
    """How an answer, whole or streamed, says it ended: the values of its
    `finish_reason`, `stop_reason` and `stop_sequence` wherever they are
    set."""
    said = set()

    def visit(value):
        if isinstance(value, dict):
            for key, item in value.items():
                if key in ("finish_reason", "stop_reason", "stop_sequence", "status") and item is not None:
                    said.add((key, item))
                visit(item)
        elif isinstance(value, list):
            for item in value:
                visit(item)
    for line in text.splitlines():
        if line.startswith("data: {"):
            visit(json.loads(line[len("data: "):]))
    if text.startswith("{"):
        visit(json.loads(text))
    return sorted(said)
