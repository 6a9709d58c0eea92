"""External agents for the tests: well-behaved ones and ones that fail in each way."""

import asyncio

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)


async def two_turns(base_url, api_key, example):
    """Asks, adds a message to the conversation, asks again; returns its last reply as the answer."""
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        messages = [{"role": "user", "content": example.prompt}]
        first = await client.chat.completions.create(model="unipg", messages=messages, max_tokens=8)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "6"}]
        second = await client.chat.completions.create(model="unipg", messages=messages, max_tokens=8)
    return {"answer": second.choices[0].message.content or ""}


async def rewrites_history(base_url, api_key, example):
    """Asks, then summarises the exchange into a fresh conversation (a new trajectory) and continues that one;
    rewards itself 1."""
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        asked = [{"role": "user", "content": example.prompt}]
        first = await client.chat.completions.create(model="unipg", messages=asked, max_tokens=6)
        summary = [{"role": "user", "content": f"Earlier you said: {first.choices[0].message.content!r}. Again?"}]
        second = await client.chat.completions.create(model="unipg", messages=summary, max_tokens=6)
        summary += [second.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "sure?"}]
        await client.chat.completions.create(model="unipg", messages=summary, max_tokens=6)
    return 1.0


async def reports_its_log_probs(base_url, api_key, example):
    """``rewrites_history`` asking for the log-probs of the sampled tokens; rewards itself their sum over its calls,
    so a trained episode whose rows hold exactly what the engine sent it has that sum as its reward."""
    total = 0.0
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:

        async def ask(messages):
            nonlocal total
            reply = await client.chat.completions.create(model="unipg", messages=messages, max_tokens=6, logprobs=True)
            total += sum(token.logprob for token in reply.choices[0].logprobs.content)
            return reply.choices[0].message

        first = await ask([{"role": "user", "content": example.prompt}])
        summary = [{"role": "user", "content": f"Earlier you said: {first.content!r}. Again?"}]
        second = await ask(summary)
        await ask([*summary, second.model_dump(exclude_none=True), {"role": "user", "content": "sure?"}])
    return total


async def rewards_itself(base_url, api_key, example):
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        await client.chat.completions.create(model="unipg", messages=[{"role": "user", "content": example.prompt}])
    return 0.25


async def raises(base_url, api_key, example):
    raise RuntimeError("agent bug")


async def hangs(base_url, api_key, example):
    await asyncio.Event().wait()


async def garbage(base_url, api_key, example):
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        await client.chat.completions.create(model="unipg", messages=[{"role": "user", "content": example.prompt}])
    return [1, 2]


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: e.g. "2*3".
    """
    return "6"


async def sdk_agent(base_url, api_key, example):
    """An OpenAI Agents SDK agent with a function tool."""
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        agent = Agent(
            name="calc",
            instructions="Use the calculator.",
            tools=[calculator],
            model=OpenAIChatCompletionsModel(model="unipg", openai_client=client),
            model_settings=ModelSettings(temperature=0.8, max_tokens=10),
        )
        result = await Runner.run(agent, example.prompt, max_turns=3)
    return str(result.final_output)


async def sdk_streamed_agent(base_url, api_key, example):
    """The Agents SDK agent, run with streaming."""
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        agent = Agent(
            name="calc",
            tools=[calculator],
            model=OpenAIChatCompletionsModel(model="unipg", openai_client=client),
            model_settings=ModelSettings(max_tokens=10),
        )
        result = Runner.run_streamed(agent, example.prompt, max_turns=3)
        async for _ in result.stream_events():
            pass
    return str(result.final_output)
