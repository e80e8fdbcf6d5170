"""Drives a running quantrouter's agent APIs with the official clients: `anthropic` on
/v1/messages and `openai` on /v1/responses.

    python agents_compat.py ROUTER_URL [--stateful] [--translated]
    python agents_compat.py ROUTER_URL --truncated

ROUTER_URL is like http://127.0.0.1:8080 (no /v1). Prints "ok <check>" per check and exits
non-zero with a message on the first failed check. With --stateful the upstreams store
responses, and a follow-up by `previous_response_id` must work; with --translated they serve
only chat, and a field with no chat form must be refused in Anthropic's error shape. With
--truncated every upstream stream ends cleanly before its answer finished: both clients must
see an error, never a finished answer.
"""

import sys
import traceback

import anthropic
import openai

TOOLS_ANTHROPIC = [
    {
        "name": "get_time",
        "description": "The time now.",
        "input_schema": {"type": "object", "properties": {}},
    }
]
TOOLS_OPENAI = [
    {
        "type": "function",
        "name": "get_time",
        "description": "The time now.",
        "parameters": {"type": "object", "properties": {}},
    }
]

checks = 0


class CheckFailed(Exception):
    pass


def check(name, condition, detail=""):
    global checks
    if not condition:
        raise CheckFailed(f"{name}: {detail!r}")
    checks += 1
    print(f"ok {name}", flush=True)


def run_messages(url, translated):
    client = anthropic.Anthropic(base_url=url, api_key="test-key", max_retries=0, timeout=30)
    ask = [{"role": "user", "content": "Say hello in French."}]

    raw = client.messages.with_raw_response.create(
        model="auto", max_tokens=256, system="Answer briefly.", messages=ask
    )
    message = raw.parse()
    check("messages.create text", message.content[0].type == "text" and message.content[0].text, message)
    check("messages.create stop_reason", message.stop_reason == "end_turn", message.stop_reason)
    check("messages.create usage", message.usage.input_tokens > 0 and message.usage.output_tokens > 0, message.usage)
    check("messages.create routed", raw.headers.get("x-quantrouter-profile"), dict(raw.headers))

    with client.messages.stream(model="auto", max_tokens=256, messages=ask) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    check("messages.stream text", text and final.content[0].text == text, (text, final))
    check("messages.stream usage", final.usage.output_tokens > 0, final.usage)

    ask_time = [{"role": "user", "content": "What time is it?"}]
    called = client.messages.create(model="auto", max_tokens=256, messages=ask_time, tools=TOOLS_ANTHROPIC)
    uses = [b for b in called.content if b.type == "tool_use"]
    check("messages tool_use", called.stop_reason == "tool_use" and uses and uses[0].name == "get_time", called)
    answered = client.messages.create(
        model="auto",
        max_tokens=256,
        tools=TOOLS_ANTHROPIC,
        messages=ask_time
        + [
            {"role": "assistant", "content": [u.model_dump() for u in uses]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "noon"}]},
        ],
    )
    check("messages tool_result answered", answered.stop_reason == "end_turn", answered)

    with client.messages.stream(model="auto", max_tokens=256, messages=ask_time, tools=TOOLS_ANTHROPIC) as stream:
        final = stream.get_final_message()
    check("messages.stream tool_use", any(b.type == "tool_use" for b in final.content), final)

    try:
        client.messages.create(
            model="auto", max_tokens=64, messages=ask, extra_body={"no_such_field": 1}
        )
        refused = None
    except anthropic.BadRequestError as e:
        refused = e
    except anthropic.APIStatusError as e:
        raise CheckFailed(f"unknown field: expected 400, got {e.status_code}") from e
    # Natively the upstream may ignore an unknown field; translated it must be refused.
    if translated:
        check("messages untranslatable refused", refused is not None, refused)
        check("messages error shape", refused.body["type"] == "error", refused.body)
        check("messages error names the field", "no_such_field" in refused.body["error"]["message"], refused.body)


def run_responses(url, stateful):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="test-key", max_retries=0, timeout=30)
    response = client.responses.create(model="auto", instructions="Answer briefly.", input="Say hello in French.")
    check("responses.create text", response.output_text, response)
    check("responses.create usage", response.usage.input_tokens > 0 and response.usage.output_tokens > 0, response.usage)

    deltas = []
    completed = None
    stream = client.responses.create(model="auto", input="Say hello in French.", stream=True)
    for event in stream:
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type == "response.completed":
            completed = event.response
    check("responses stream deltas", deltas, deltas)
    check("responses stream completed", completed and completed.output_text == "".join(deltas), completed)

    called = client.responses.create(model="auto", input="What time is it?", tools=TOOLS_OPENAI)
    calls = [item for item in called.output if item.type == "function_call"]
    check("responses function_call", calls and calls[0].name == "get_time", called)
    answered = client.responses.create(
        model="auto",
        tools=TOOLS_OPENAI,
        input=[
            {"role": "user", "content": "What time is it?"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "get_time", "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "noon"},
        ],
    )
    check("responses function_call_output answered", answered.output_text, answered)

    if stateful:
        follow = client.responses.create(model="auto", input="And in Spanish?", previous_response_id=response.id)
        check("responses previous_response_id", follow.previous_response_id == response.id, follow)
        fetched = client.responses.retrieve(response.id)
        check("responses.retrieve", fetched.id == response.id and fetched.output_text == response.output_text, fetched)
    try:
        client.responses.create(model="auto", input="x", previous_response_id="resp_unknown")
        raise CheckFailed("unknown previous_response_id: expected an error")
    except openai.NotFoundError as e:
        check("responses unknown previous_response_id", e.status_code == 404, e)


def run_truncated(url):
    """The upstream cuts off every stream whose prompt says "cut me off" (`edge_upstream` in
    agent_apis.rs): the clients must raise or see an error event."""
    ask = [{"role": "user", "content": "Tell me a long story (cut me off)."}]
    client = anthropic.Anthropic(base_url=url, api_key="test-key", max_retries=0, timeout=30)
    try:
        with client.messages.stream(model="auto", max_tokens=400, messages=ask) as stream:
            final = stream.get_final_message()
        raise CheckFailed(f"messages: a cut stream was taken as finished: {final}")
    except anthropic.APIStatusError as e:
        check("messages cut stream raises", e.body["type"] == "error", e.body)

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="test-key", max_retries=0, timeout=30)
    types = [e.type for e in client.responses.create(model="auto", input="Tell me a long story (cut me off).", stream=True)]
    check("responses cut stream ends with error", types[-1] == "error", types)
    check("responses cut stream never completes", "response.completed" not in types, types)
    try:
        with client.responses.stream(model="auto", input="Tell me a long story (cut me off).") as stream:
            final = stream.get_final_response()
        raise CheckFailed(f"responses: a cut stream was taken as finished: {final}")
    except (openai.APIError, RuntimeError) as e:
        check("responses.stream cut stream raises", True, e)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    flags = [a for a in sys.argv[1:] if a.startswith("--")]
    if len(args) != 1 or [f for f in flags if f not in ("--stateful", "--translated", "--truncated")]:
        print(f"usage: {sys.argv[0]} ROUTER_URL [--stateful] [--translated] | --truncated", file=sys.stderr)
        sys.exit(2)
    try:
        if "--truncated" in flags:
            run_truncated(args[0])
        else:
            run_messages(args[0], "--translated" in flags)
            run_responses(args[0], "--stateful" in flags)
    except CheckFailed as e:
        print(f"FAILED {e}", flush=True)
        sys.exit(1)
    except (anthropic.APIError, openai.APIError) as e:
        print(f"FAILED after {checks} checks: {type(e).__name__}: {e}", flush=True)
        sys.exit(1)
    except Exception as e:
        traceback.print_exc()
        print(f"FAILED after {checks} checks: {type(e).__name__}: {e}", flush=True)
        sys.exit(1)
    print(f"agent clients: {checks} checks passed", flush=True)


if __name__ == "__main__":
    main()
