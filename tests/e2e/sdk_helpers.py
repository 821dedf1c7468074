"""The official SDKs' streaming helpers against a fleet, as people use them:
OpenAI's `responses.stream()` and `chat.completions.stream()`, the Responses
API's raw events with every field the spec gives them, and Anthropic's
`messages.stream()`; each with text and with a function call, and the
call's result sent back. Run by the end-to-end suite on real llama-server
fleets and by the quickstart's smoke test on the simulated one:

    python sdk_helpers.py BASE_URL MODEL [API_KEY]
"""

import json
import sys

import anthropic
import openai

# The tool every call is made to, named by the request's tool choice, at
# temperature 0, so the model's answer is the same each run, stopped at the
# call's closing tag in the template's form (deploy/local/gemma.jinja), so
# the model makes one.
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
QUESTION = "What is the weather in Paris?"
RESULT = "Sunny, 21 C."
# Asked of the model: a request's tool choice, whatever it says, does not
# hold llama-server b11434's model to a call (its grammar waits for the
# call's tag), and Gemma 3 270M calls for this question reliably only when
# told to.
SYSTEM = "Answer by calling a tool."
CALL_END = ["</tool_call>"]
# The fewest tokens a call to get_weather takes in a prompt, tags and all
# (about 25 of Gemma's, more of the simulator's).
CALL_TOKENS = 15

# Fields the OpenAI spec gives the events about an output item's content.
CONTENT_FIELDS = ("output_index", "content_index", "item_id")


def responses_stream(client, model):
    """`responses.stream()`: its events, text and final response agree."""
    with client.responses.stream(model=model, input="Say hello.", max_output_tokens=8) as stream:
        events = list(stream)
        final = stream.get_final_response()
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and final.output_text == text, (text, final)
    assert final.status == "completed" and final.usage.output_tokens > 0, final
    return events


def responses_events(client, model):
    """The raw Responses stream: every event numbered in order from 0, and
    every content event naming its item, output and content part."""
    events = list(client.responses.create(model=model, input="Say hello.", max_output_tokens=8, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events))), events
    assert events[0].type == "response.created" and events[-1].type == "response.completed", events
    added = next(e for e in events if e.type == "response.output_item.added")
    content = [e for e in events if e.type.startswith(("response.content_part.", "response.output_text."))]
    assert content, events
    for event in content:
        assert all(getattr(event, name, None) is not None for name in CONTENT_FIELDS), event
        assert (event.output_index, event.content_index, event.item_id) == (0, 0, added.item.id), event
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert all(isinstance(e.logprobs, list) for e in deltas), deltas
    return events


def responses_stream_call(client, model):
    """`responses.stream()` with a function call: the call's argument
    deltas are the final response's arguments, item by item, and the call
    and its result sent back are answered. The Responses API has no stop
    sequences: the model goes on calling until its limit, and the last call
    may be cut (so the tool is not `strict`, which has the SDK parse every
    call's arguments)."""
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city",
            "parameters": WEATHER}
    with client.responses.stream(model=model, instructions=SYSTEM, input=QUESTION, tools=[tool], max_output_tokens=64,
                                 temperature=0, tool_choice={"type": "function", "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather", final
    for call in calls:
        deltas = [e.delta for e in events
                  if e.type == "response.function_call_arguments.delta" and e.item_id == call.id]
        assert "".join(deltas) == call.arguments, (deltas, call)
    assert json.loads(calls[0].arguments)["city"], calls[0]
    said = [item.model_dump(include={"type", "role", "content", "call_id", "name", "arguments"})
            for item in final.output[:final.output.index(calls[0]) + 1]]
    answer = client.responses.create(model=model, instructions=SYSTEM, max_output_tokens=8, temperature=0,
                                     tools=[tool], input=[
                                         {"role": "user", "content": QUESTION}, *said,
                                         {"type": "function_call_output", "call_id": calls[0].call_id,
                                          "output": RESULT}])
    assert answer.status == "completed" and answer.usage.input_tokens > final.usage.input_tokens, answer
    return final


def chat_stream(client, model):
    """`chat.completions.stream()`: the final completion is what streamed.
    A reply cut at its limit is the SDK's LengthFinishReasonError, which
    carries the completion."""
    with client.chat.completions.stream(model=model, max_tokens=16,
                                        messages=[{"role": "user", "content": "Say hello."}]) as stream:
        text = "".join(e.delta for e in stream if e.type == "content.delta")
        try:
            final = stream.get_final_completion()
        except openai.LengthFinishReasonError as cut:
            final = cut.completion
    assert text and final.choices[0].message.content == text, (text, final)
    assert final.choices[0].finish_reason in ("stop", "length"), final
    return final


def chat_stream_call(client, model):
    """`chat.completions.stream()` with a function call: the SDK's argument
    events add up to the final completion's call, and the call and its
    result sent back are answered. The real model goes on calling until
    its limit, the SDK's LengthFinishReasonError (which carries the
    completion); the first call is whole."""
    tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": WEATHER, "strict": True}}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    done = []
    try:
        with client.chat.completions.stream(model=model, max_tokens=64, temperature=0, messages=messages,
                                            tools=[tool], stop=CALL_END, stream_options={"include_usage": True},
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            ) as stream:
            # Collected as they come: a cut answer raises within the loop.
            for event in stream:
                if event.type == "tool_calls.function.arguments.done":
                    done.append(event)
            final = stream.get_final_completion()
    except openai.LengthFinishReasonError as cut:
        final = cut.completion
    message = final.choices[0].message
    assert final.choices[0].finish_reason in ("tool_calls", "length"), final
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather", final
    call = message.tool_calls[0]
    assert json.loads(call.function.arguments)["city"], call
    if len(message.tool_calls) > 1 or final.choices[0].finish_reason == "tool_calls":
        # The SDK says a call is done when the next begins, or the answer ends.
        assert done and done[0].name == "get_weather" and done[0].arguments == call.function.arguments, done
    said = [{"role": "assistant", "content": message.content,
             "tool_calls": [call.model_dump(include={"id", "type", "function"})]},
            {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    answer = client.chat.completions.create(model=model, max_tokens=8, temperature=0, messages=messages + said,
                                            tools=[tool])
    # The same turn with the call left out (its text, the result as the
    # user's): the call is in the prompt only where this one is shorter.
    unsaid = [{"role": "assistant", "content": message.content}, {"role": "user", "content": RESULT}]
    without = client.chat.completions.create(model=model, max_tokens=1, temperature=0, messages=messages + unsaid,
                                             tools=[tool])
    assert answer.usage.prompt_tokens >= without.usage.prompt_tokens + CALL_TOKENS, (answer.usage, without.usage)
    return final


def messages_stream(base_url, api_key, model):
    """Anthropic's `messages.stream()`, two turns: the text stream is the
    final message's text."""
    claude = anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    conversation = [{"role": "user", "content": "Say hello."}]
    for _ in range(2):
        with claude.messages.stream(model=model, max_tokens=8, messages=conversation) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text and final.content[0].text == text, final
        assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0, final
        conversation += [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    return final


def messages_stream_tool_use(base_url, api_key, model):
    """Anthropic's `messages.stream()` with a named tool: the `input_json`
    deltas of the first tool use build its input, and the message and the
    tool's result sent back are answered."""
    claude = anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    tool = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}
    conversation = [{"role": "user", "content": QUESTION}]
    with claude.messages.stream(model=model, system=SYSTEM, max_tokens=64, messages=conversation, tools=[tool],
                                tool_choice={"type": "tool", "name": "get_weather"}, stop_sequences=CALL_END,
                                extra_body={"temperature": 0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    uses = [(i, block) for i, block in enumerate(final.content) if block.type == "tool_use"]
    assert uses and uses[0][1].name == "get_weather" and uses[0][1].input["city"], final
    first, use = uses[0]
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                      and e.index == first and e.delta.type == "input_json_delta")
    assert json.loads(partial) == use.input, (partial, use)
    assert final.stop_reason in ("tool_use", "max_tokens"), final
    said = [block.model_dump(include={"type", "text", "id", "name", "input"}) for block in final.content[:first + 1]]
    answer = claude.messages.create(model=model, system=SYSTEM, max_tokens=8, tools=[tool], messages=conversation + [
        {"role": "assistant", "content": said},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}])
    # The same turn with the call left out, as in chat_stream_call.
    text = [block for block in said if block["type"] == "text"]
    without = claude.messages.create(model=model, system=SYSTEM, max_tokens=1, tools=[tool], messages=conversation + [
        {"role": "assistant", "content": text}, {"role": "user", "content": RESULT}])

    def prompt(usage):
        return usage.input_tokens + (usage.cache_read_input_tokens or 0)
    assert prompt(answer.usage) >= prompt(without.usage) + CALL_TOKENS, (answer.usage, without.usage)
    return final


def check(base_url, model, api_key="none", calls=True):
    """Every helper; with `calls`, each with a function call too, which
    needs a model whose template offers tools."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=120)
    responses_stream(client, model)
    responses_events(client, model)
    chat_stream(client, model)
    messages_stream(base_url, api_key, model)
    if calls:
        responses_stream_call(client, model)
        chat_stream_call(client, model)
        messages_stream_tool_use(base_url, api_key, model)


if __name__ == "__main__":
    check(*sys.argv[1:])
    print("every SDK streaming helper passed")
