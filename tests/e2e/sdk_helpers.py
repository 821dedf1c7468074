"""The official SDKs' streaming helpers against a fleet, as people use them:
OpenAI's `responses.stream()` and `chat.completions.stream()`, the Responses
API's raw events with every field the spec gives them, and Anthropic's
`messages.stream()`. Run by the end-to-end suite on real llama-server
fleets and by the quickstart's smoke test on the simulated one:

    python sdk_helpers.py BASE_URL MODEL [API_KEY]
"""

import sys

import anthropic
import openai

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


def check(base_url, model, api_key="none"):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=120)
    responses_stream(client, model)
    responses_events(client, model)
    chat_stream(client, model)
    messages_stream(base_url, api_key, model)


if __name__ == "__main__":
    check(*sys.argv[1:])
    print("every SDK streaming helper passed")
