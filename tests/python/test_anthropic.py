"""The official `anthropic` client against `osprey serve`'s Messages API on a tiny synthetic model.

Run by .ci/run:  OSPREY_BIN=target/debug/osprey python -m pytest tests/python
"""
import anthropic
import pytest

TOOLS = [{"name": "get_weather", "description": "Weather for a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
NO_THINK = {"type": "disabled"}


@pytest.fixture(scope="module")
def client(osprey_server):
    return anthropic.Anthropic(base_url=osprey_server, api_key="test-key")


def test_message(client):
    m = client.messages.create(model="tiny", max_tokens=6, messages=[{"role": "user", "content": "Hello"}],
                               extra_body={"temperature": 0})
    assert m.type == "message" and m.role == "assistant"
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert 0 < m.usage.output_tokens <= 6


def test_streaming_builds_the_same_message(client):
    # (this SDK takes no `temperature` argument; the server still reads the field)
    kwargs = dict(model="tiny", max_tokens=8, thinking=NO_THINK, extra_body={"temperature": 0},
                  messages=[{"role": "user", "content": "Tell me a story."}])
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert text == "".join(b.text for b in whole.content if b.type == "text")
    assert final.stop_reason == whole.stop_reason


def test_tool_use_round_trip(client):
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    m = client.messages.create(model="tiny", max_tokens=10, tools=TOOLS, thinking=NO_THINK,
                               tool_choice={"type": "tool", "name": "get_weather"}, messages=messages)
    calls = [b for b in m.content if b.type == "tool_use"]
    assert calls and calls[0].name == "get_weather" and isinstance(calls[0].input, dict)
    assert calls[0].id.startswith("toolu_")
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "21C"}]}]
    m2 = client.messages.create(model="tiny", max_tokens=6, tools=TOOLS, thinking=NO_THINK, messages=messages)
    assert m2.stop_reason in ("end_turn", "max_tokens", "tool_use")
    total = lambda u: u.input_tokens + u.cache_read_input_tokens  # noqa: E731
    assert total(m2.usage) > total(m.usage)


def test_count_tokens_matches_the_prompt(client):
    messages = [{"role": "user", "content": "Count these words, please, exactly once."}]
    n = client.messages.count_tokens(model="tiny", messages=messages, tools=TOOLS)
    m = client.messages.create(model="tiny", max_tokens=1, messages=messages, tools=TOOLS)
    assert n.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_errors_surface_as_anthropic_exceptions(client):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError, match="'image' blocks are not supported"):
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [image]}])
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-other", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    bad = anthropic.Anthropic(base_url=client.base_url, api_key="wrong")
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "x"}])


def test_models_list(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].type == "model"


def test_thinking_budget_closes_the_thinking_block(client):
    kwargs = dict(model="tiny", max_tokens=12, extra_body={"temperature": 0},
                  messages=[{"role": "user", "content": "Hello"}])
    free = client.messages.create(thinking={"type": "enabled", "budget_tokens": 1024}, **kwargs)
    capped = client.messages.create(thinking={"type": "enabled", "budget_tokens": 3}, **kwargs)
    # the tiny model's random weights think through all 12 tokens unless the budget ends it
    assert [b.type for b in free.content] == ["thinking"]
    assert [b.type for b in capped.content][:2] == ["thinking", "text"]
    assert free.content[0].thinking.startswith(capped.content[0].thinking.rstrip())


def test_prefilled_reply_is_continued(client):
    messages = [{"role": "user", "content": "Reply in JSON."}, {"role": "assistant", "content": "{\"answer\":"}]
    kwargs = dict(model="tiny", max_tokens=6, messages=messages, extra_body={"temperature": 0})
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    # the prompt ends inside the answer, so the reply has no thinking block
    assert [b.type for b in whole.content] == ["text"], whole.content
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    n = client.messages.count_tokens(model="tiny", messages=messages)
    assert n.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_structured_output_parses_into_a_pydantic_model(client):
    # the SDK's own helper sends output_config.format; the tiny model's random weights answer in
    # the schema only because the server's grammar holds them to it
    from typing import Literal

    from pydantic import BaseModel

    class Verdict(BaseModel):
        ok: bool
        mood: Literal["calm", "tense"]

    m = client.messages.parse(model="tiny", max_tokens=64, thinking=NO_THINK, output_format=Verdict,
                              messages=[{"role": "user", "content": "Judge this."}], extra_body={"temperature": 0})
    assert isinstance(m.parsed_output, Verdict), m.content
    assert m.stop_reason == "end_turn"
