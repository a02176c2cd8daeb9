"""Drive a running tandem-dataplane with the official `openai` client, unchanged.

usage: openai_client_check.py BASE_URL MODEL
Exits non-zero (with the reason) if any check fails.
"""
import sys

import openai


def main() -> None:
    base, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)

    models = [m.id for m in client.models.list().data]
    assert model in models, models

    msgs = [{"role": "user", "content": "Say hello."}]
    r = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=8, temperature=0, logprobs=True, top_logprobs=0
    )
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    assert text, r
    # The usage accounts for every token generated: one logprobs entry per token the text
    # is made of, plus the end-of-generation token when that is what stopped it; eight
    # tokens exactly when max_tokens ended it.
    u, finish0 = r.usage, r.choices[0].finish_reason
    entries = r.choices[0].logprobs.content
    assert u.prompt_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens, u
    assert "".join(e.token for e in entries) == text, (entries, text)
    if finish0 == "length":
        assert u.completion_tokens == 8 == len(entries), (u, len(entries))
    else:
        assert finish0 == "stop", finish0
        assert len(entries) <= u.completion_tokens <= len(entries) + 1 <= 8, (u, len(entries))

    parts = []
    finish = None
    usage = None
    for chunk in client.chat.completions.create(
        model=model, messages=msgs, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                parts.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    assert "".join(parts) == text, ("".join(parts), text)
    assert finish == finish0, (finish, finish0)
    assert usage is not None and usage.completion_tokens == r.usage.completion_tokens, usage

    c = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert c.choices[0].text, c

    try:
        client.chat.completions.create(model=model, messages=[], max_tokens=4)
    except openai.BadRequestError as e:
        assert e.status_code == 400
    else:
        raise AssertionError("empty messages must be rejected")

    print("openai client: all checks passed")


if __name__ == "__main__":
    main()
