#!/usr/bin/env python3
"""Render chat templates as HF transformers' `apply_chat_template` renders them: jinja2's
ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loopcontrols
extension, a `tojson` filter that is `json.dumps(..., ensure_ascii=False)`, and the
`raise_exception` and `strftime_now` globals; the context is `messages`, `tools`,
`add_generation_prompt` and the special tokens. The reference Tandem's minijinja rendering
is held against (dataplane/tests/chat_templates.rs).

stdin: {"template": "...", "parse_tool_arguments": bool (tool-call arguments that are JSON
        strings become the objects they encode, in their order, as vLLM and llama.cpp give
        them to templates), "cases": [{"messages": [...], "tools": [...] | null,
        "add_generation_prompt": bool, "bos_token": "...", "eos_token": "..."}, ...]}
stdout: a JSON list with, per case, {"text": "..."} or {"error": "..."}.
"""
import json
import sys
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def main():
    req = json.load(sys.stdin)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    template = env.from_string(req["template"])
    out = []
    for c in req["cases"]:
        if req.get("parse_tool_arguments"):
            for m in c["messages"]:
                for call in m.get("tool_calls") or []:
                    args = call.get("function", {}).get("arguments")
                    if isinstance(args, str):
                        try:
                            call["function"]["arguments"] = json.loads(args)
                        except ValueError:
                            pass
        try:
            out.append({"text": template.render(
                messages=c["messages"], tools=c.get("tools"),
                add_generation_prompt=c["add_generation_prompt"],
                bos_token=c.get("bos_token", ""), eos_token=c.get("eos_token", ""))})
        except Exception as e:  # noqa: BLE001 - any failure of the template is its answer
            out.append({"error": str(e)})
    json.dump(out, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
