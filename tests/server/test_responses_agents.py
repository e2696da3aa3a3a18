"""The OpenAI Agents SDK (openai-agents), which speaks only the Responses API, runs an agent with one
function tool through two turns against a live server on the default model. The first turn's call is
forced (tool_choice, reset after the tool ran), since a 135M model would not choose it: the check is
the protocol (the SDK parsed the call, ran the tool, sent its output back and got a final answer),
not the answer's quality."""

from __future__ import annotations

import asyncio

import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

from ember.default_model import default_model_path
from tests.server.live import MODEL_NAME, start_server


@pytest.fixture(scope="module")
def live():
    set_tracing_disabled(True)  # no exporter: nothing leaves loopback
    server = start_server(default_model_path(), dtype="auto", num_threads=2, kv_cache_memory=0.2, max_model_len=2048)
    yield server
    server.stop()


def weather_agent(live) -> tuple[Agent, list[str]]:
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"It is sunny in {city}."

    client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=120)
    agent = Agent(
        name="weather",
        instructions="Answer weather questions with the get_weather tool.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=MODEL_NAME, openai_client=client),
        model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=60),
        reset_tool_choice=True,  # after the tool ran, tool_choice goes back to auto: the model answers
    )
    return agent, cities


@pytest.mark.parametrize("streamed", [False, True])
def test_an_agent_calls_its_tool_then_answers(live, streamed):
    agent, cities = weather_agent(live)

    async def run():
        if not streamed:
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=3)
        result = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    assert len(cities) == 1 and cities[0]  # the tool ran once, with the argument the model wrote
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert len(result.raw_responses) == 2  # two turns, two Responses
    assert all(r.response_id.startswith("resp_") for r in result.raw_responses)
    live.wait_idle()
