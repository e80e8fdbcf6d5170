"""Drives a running quantrouter with the official `openai` Python client.

    python openai_compat.py BASE_URL [--check-auth]

BASE_URL is like http://127.0.0.1:8080/v1. Exits non-zero with a message on the first failed
check. With --check-auth the router must require the API key "test-key".
"""

import sys

import openai
from openai import OpenAI

checks = 0


def check(name, condition, detail=""):
    global checks
    if not condition:
        print(f"FAILED {name}: {detail}", flush=True)
        sys.exit(1)
    checks += 1
    print(f"ok {name}", flush=True)


def main():
    base_url = sys.argv[1]
    check_auth = "--check-auth" in sys.argv[2:]
    client = OpenAI(base_url=base_url, api_key="test-key", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "Say hello in French."}]

    models = [m.id for m in client.models.list()]
    check("models.list", "auto" in models, models)

    raw = client.chat.completions.with_raw_response.create(
        model="auto", messages=messages, max_tokens=16
    )
    reply = raw.parse()
    choice = reply.choices[0]
    check("chat.completions", bool(choice.message.content), reply)
    check("chat usage", reply.usage is not None and reply.usage.completion_tokens <= 16, reply.usage)
    check("chat finish_reason", choice.finish_reason in ("stop", "length"), choice.finish_reason)
    check("x-quantrouter-profile", bool(raw.headers.get("x-quantrouter-profile")), dict(raw.headers))

    text, last = "", None
    for chunk in client.chat.completions.create(
        model="auto",
        messages=messages,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    ):
        last = chunk
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    check("chat stream text", bool(text), text)
    check("chat stream usage", last is not None and last.usage is not None, last)

    completion = client.completions.create(model="auto", prompt="Once upon a time", max_tokens=8)
    check("completions", bool(completion.choices[0].text), completion)

    try:
        client.chat.completions.create(model="no-such-model", messages=messages)
        check("unknown model is 404", False, "no error raised")
    except openai.NotFoundError as e:
        check("unknown model is 404", e.status_code == 404, e)

    try:
        client.chat.completions.create(model="auto", messages=messages, max_tokens=-1)
        check("max_tokens -1 is 400", False, "no error raised")
    except openai.BadRequestError as e:
        check("max_tokens -1 is 400", e.status_code == 400, e)

    if check_auth:
        wrong = OpenAI(base_url=base_url, api_key="wrong", max_retries=0, timeout=30)
        try:
            wrong.chat.completions.create(model="auto", messages=messages)
            check("wrong key is 401", False, "no error raised")
        except openai.AuthenticationError as e:
            check("wrong key is 401", e.status_code == 401, e)

    print(f"openai client: {checks} checks passed", flush=True)


if __name__ == "__main__":
    main()
