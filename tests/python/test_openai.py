"""The official `openai` client against `osprey serve` on a tiny synthetic model.

Run by .ci/run:  OSPREY_BIN=target/debug/osprey python -m pytest tests/python
"""
import json

import pytest
from openai import OpenAI

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def client(osprey_server):
    return OpenAI(base_url=osprey_server + "/v1", api_key="test-key")


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_non_streaming(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                       max_tokens=6, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming(client):
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=6, stream=True, stream_options={"include_usage": True},
                                            extra_body=NO_THINK)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["length"], ["stop"])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 6


def test_tool_call_round_trip(client):
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       extra_body=NO_THINK)
    msg = r.choices[0].message
    assert msg.tool_calls and msg.tool_calls[0].function.name == "get_weather"
    assert isinstance(json.loads(msg.tool_calls[0].function.arguments), dict)
    messages.append({"role": "assistant", "content": msg.content or "",
                     "tool_calls": [tc.model_dump() for tc in msg.tool_calls]})
    messages.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": '{"temp": 21}'})
    r2 = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=6, extra_body=NO_THINK)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens


def test_multi_turn_reuses_cached_state(client):
    messages = [{"role": "user", "content": "Tell me about ospreys."}]
    r1 = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, extra_body=NO_THINK)
    messages += [{"role": "assistant", "content": r1.choices[0].message.content},
                 {"role": "user", "content": "And their nests?"}]
    r2 = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, extra_body=NO_THINK)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= r1.usage.prompt_tokens - 5
    assert cached < r2.usage.prompt_tokens


def test_errors_surface_as_openai_exceptions(client):
    import openai
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=17)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    bad = OpenAI(base_url=client.base_url, api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_structured_output_parses_into_a_pydantic_model(client):
    # the client's own structured-output helper: a strict json_schema made from the model class;
    # the tiny model's weights are random, so only the grammar makes its reply fit
    from typing import Literal

    from pydantic import BaseModel, Field

    class Forecast(BaseModel):
        rain: bool
        days: int = Field(ge=1, le=7)
        sky: Literal["clear", "cloudy"]

    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
        r = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "Weather this week?"}],
                                          response_format=Forecast, max_tokens=64, extra_body=NO_THINK, **sampling)
        forecast = r.choices[0].message.parsed
        assert isinstance(forecast, Forecast) and 1 <= forecast.days <= 7
        assert r.choices[0].finish_reason == "stop"


def test_logit_bias_forces_a_token(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                       max_tokens=4, temperature=0, logprobs=True, logit_bias={"1000": 100},
                                       extra_body=NO_THINK)
    tokens = [e.token for e in r.choices[0].logprobs.content]
    assert len(tokens) == 4 and len(set(tokens)) == 1, tokens
    with pytest.raises(Exception) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                       max_tokens=4, logit_bias={"1000": 500})
    assert "logit_bias" in str(e.value)


def test_n_choices_whole_and_streamed(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2, seed=11,
                  extra_body=NO_THINK)
    r = client.chat.completions.create(**kwargs)
    assert [c.index for c in r.choices] == [0, 1]
    assert 2 <= r.usage.completion_tokens <= 8  # both choices' tokens
    streamed = {0: "", 1: ""}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert [streamed[0], streamed[1]] == [c.message.content for c in r.choices]


def test_completions_echo_prompt_logprobs_as_lm_eval_asks(client):
    # lm-evaluation-harness's loglikelihood request (local-completions): token lists, echo,
    # one token, logprobs=1; it sums token_logprobs[ctxlen:-1] and checks each against the top
    r = client.completions.create(model="tiny", prompt=[[760, 4087, 369], [760, 4087]], max_tokens=1,
                                  temperature=0, logprobs=1, echo=True, seed=1234)
    assert [c.index for c in r.choices] == [0, 1]
    for c, n in zip(r.choices, [3, 2]):
        lp = c.logprobs
        assert len(lp.token_logprobs) == n + 1 and lp.token_logprobs[0] is None
        assert all(x <= 0 for x in lp.token_logprobs[1:])
        # the greedy token generated last is the top alternative
        assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())
    assert r.usage.prompt_tokens == 5


def test_a_reply_begun_by_the_caller_is_continued(client):
    # vLLM's form: the prompt ends inside the final assistant message, and the reply is the rest
    begun = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    r = client.chat.completions.create(model="tiny", messages=begun, max_tokens=4, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    m = r.choices[0].message
    assert m.content and getattr(m, "reasoning_content", None) is None, m
    asked = client.chat.completions.create(model="tiny", messages=begun[:1], max_tokens=1, extra_body=NO_THINK)
    # "<think>\n\n</think>\n\n" as with thinking off, then the begun reply
    assert r.usage.prompt_tokens > asked.usage.prompt_tokens


RESPONSE_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                  "required": ["city"]}}]


def test_responses_api_streams_what_it_returns(client):
    kwargs = dict(model="tiny", input="Tell me a story.", max_output_tokens=8, temperature=0,
                  reasoning={"effort": "none"})
    whole = client.responses.create(**kwargs)
    assert whole.object == "response" and whole.status in ("completed", "incomplete")
    assert [o.type for o in whole.output] == ["message"]
    assert whole.usage.output_tokens <= 8 and whole.usage.output_tokens_details.reasoning_tokens == 0
    with client.responses.stream(**kwargs) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == whole.output_text == deltas
    assert final.status == whole.status


def test_responses_api_reasoning_and_a_function_call_round_trip(client):
    thought = client.responses.create(model="tiny", input="Hello", max_output_tokens=6, temperature=0)
    assert [o.type for o in thought.output] == ["reasoning"]
    assert thought.usage.output_tokens_details.reasoning_tokens == thought.usage.output_tokens
    items = [{"role": "user", "content": "What's the weather in Paris?"}]
    r = client.responses.create(model="tiny", input=items, tools=RESPONSE_TOOLS, max_output_tokens=12,
                                tool_choice={"type": "function", "name": "get_weather"},
                                reasoning={"effort": "none"})
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments), dict)
    with client.responses.stream(model="tiny", input=items, tools=RESPONSE_TOOLS, max_output_tokens=12,
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 reasoning={"effort": "none"}) as stream:
        fragments = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        streamed = [o for o in stream.get_final_response().output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    assert fragments == calls[0].arguments
    items += [c.model_dump(exclude_none=True) for c in calls]
    items.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temp": 21}'})
    r2 = client.responses.create(model="tiny", input=items, tools=RESPONSE_TOOLS, max_output_tokens=6,
                                 reasoning={"effort": "none"})
    assert r2.usage.input_tokens > r.usage.input_tokens
    # the stored conversation continues: only the new input is sent, the prefix is cached
    follow = client.responses.create(model="tiny", input="And tomorrow?", previous_response_id=r2.id,
                                     tools=RESPONSE_TOOLS, max_output_tokens=4, reasoning={"effort": "none"})
    assert follow.previous_response_id == r2.id
    assert follow.usage.input_tokens > r2.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens > 0
    unstored = client.responses.create(model="tiny", input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(Exception) as e:
        client.responses.create(model="tiny", input="Hi", previous_response_id=unstored.id)
    assert "previous_response_id" in str(e.value) and "not found" in str(e.value)
