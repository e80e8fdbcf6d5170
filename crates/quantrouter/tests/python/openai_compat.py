"""Drives a running quantrouter with the official `openai` Python client.

    python openai_compat.py BASE_URL [--check-auth]

BASE_URL is like http://127.0.0.1:8080/v1. Prints "ok <check>" per check and exits non-zero
with a message on the first failed check. With --check-auth the router must require the API
key "test-key" (and reject any other key with 401).
"""

import sys
import traceback

import openai
from openai import OpenAI

MESSAGES = [{"role": "user", "content": "Say hello in French."}]

checks = 0


class CheckFailed(Exception):
    pass


def check(name, condition, detail=""):
    global checks
    if not condition:
        raise CheckFailed(f"{name}: {detail!r}")
    checks += 1
    print(f"ok {name}", flush=True)


def expect_error(name, error_class, status, call):
    """Checks that `call()` raises `error_class` with HTTP `status`."""
    try:
        result = call()
    except error_class as e:
        check(name, e.status_code == status, f"status {e.status_code}: {e}")
        return
    except openai.APIStatusError as e:
        raise CheckFailed(
            f"{name}: expected {error_class.__name__} ({status}), "
            f"got {type(e).__name__} ({e.status_code}): {e}"
        ) from e
    raise CheckFailed(f"{name}: expected {error_class.__name__} ({status}), got {result!r}")


def run(base_url, check_auth):
    client = OpenAI(base_url=base_url, api_key="test-key", max_retries=0, timeout=30)

    # (a) the model list names the routing model "auto"
    models = [m.id for m in client.models.list()]
    check("models.list", "auto" in models, models)

    # (b) a chat completion, read through the raw response to see the router's headers
    raw = client.chat.completions.with_raw_response.create(
        model="auto", messages=MESSAGES, max_tokens=16
    )
    reply = raw.parse()
    check("chat.completions choices", len(reply.choices) >= 1, reply)
    choice = reply.choices[0]
    check("chat.completions content", bool(choice.message.content), reply)
    check(
        "chat.completions usage",
        reply.usage is not None and reply.usage.completion_tokens <= 16,
        reply.usage,
    )
    check(
        "chat.completions finish_reason",
        choice.finish_reason in ("stop", "length"),
        choice.finish_reason,
    )
    check(
        "x-quantrouter-profile header",
        bool(raw.headers.get("x-quantrouter-profile")),
        dict(raw.headers),
    )

    # (c) streaming chat, with the usage chunk at the end
    text, last, chunks = "", None, 0
    stream = client.chat.completions.create(
        model="auto",
        messages=MESSAGES,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        chunks += 1
        last = chunk
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    check("chat stream text", bool(text), f"{chunks} chunks, text {text!r}")
    check(
        "chat stream usage",
        last is not None and last.usage is not None and last.usage.completion_tokens <= 16,
        last,
    )

    # (d) legacy text completion
    completion = client.completions.create(model="auto", prompt="Once upon a time", max_tokens=8)
    check(
        "completions",
        bool(completion.choices) and bool(completion.choices[0].text),
        completion,
    )

    # (e) errors map onto the client's exception classes
    expect_error(
        "unknown model is 404",
        openai.NotFoundError,
        404,
        lambda: client.chat.completions.create(model="no-such-model", messages=MESSAGES),
    )
    expect_error(
        "max_tokens -1 is 400",
        openai.BadRequestError,
        400,
        lambda: client.chat.completions.create(model="auto", messages=MESSAGES, max_tokens=-1),
    )

    if check_auth:
        wrong = OpenAI(base_url=base_url, api_key="wrong", max_retries=0, timeout=30)
        expect_error(
            "wrong key is 401",
            openai.AuthenticationError,
            401,
            lambda: wrong.chat.completions.create(model="auto", messages=MESSAGES),
        )
        expect_error(
            "wrong key is 401 on models.list",
            openai.AuthenticationError,
            401,
            lambda: wrong.models.list(),
        )


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    flags = [a for a in sys.argv[1:] if a.startswith("--")]
    unknown = [f for f in flags if f != "--check-auth"]
    if len(args) != 1 or unknown:
        print(f"usage: {sys.argv[0]} BASE_URL [--check-auth]", file=sys.stderr)
        sys.exit(2)
    try:
        run(args[0], "--check-auth" in flags)
    except CheckFailed as e:
        print(f"FAILED {e}", flush=True)
        sys.exit(1)
    except openai.APIError as e:  # connection refused, timeout, an unexpected status, ...
        cause = f" (caused by {type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else ""
        print(f"FAILED after {checks} checks: {type(e).__name__}: {e}{cause}", flush=True)
        sys.exit(1)
    except Exception as e:  # a bug in the response the client could not handle
        traceback.print_exc()
        print(f"FAILED after {checks} checks: {type(e).__name__}: {e}", flush=True)
        sys.exit(1)
    print(f"openai client: {checks} checks passed", flush=True)


if __name__ == "__main__":
    main()
