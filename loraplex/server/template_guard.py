"""Limits on a chat template sent with the request (``chat_template``, served only with
``--trust-request-chat-template``). Jinja's sandbox keeps a template from reaching the server's
objects, not from running long: nested ``range`` loops can run for hours, a recursive macro
overflows the stack, and ``'x' * 10**9`` builds a gigabyte prompt in one step. It renders on the
one tokenizer thread (``AppContext.run_tokenizer``), which every other request's prompt waits
for, and a Python thread cannot be stopped from outside; so the render stops itself:

- a deadline (``RENDER_SECONDS``), checked by a trace function on the rendering thread as the
  template's compiled Python runs (tracing costs time, and only a request's own template pays it);
- a cap on the rendered text (``MAX_CHARS_PER_TOKEN`` per token of the context), checked before
  the tokenizer reads it: longer text cannot fit the context anyway;
- the stack overflow and memory errors a template can raise.

Each is a ``TemplateLimitError`` (a jinja2 ``TemplateError``), a 400 naming ``chat_template``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from jinja2 import TemplateError

RENDER_SECONDS = 5.0
MAX_CHARS_PER_TOKEN = 64  # far above any tokenizer's average (about 4 for English)


class TemplateLimitError(TemplateError):
    pass


def render_limited(render: Callable[[], str], max_model_len: int, seconds: float | None = None) -> str:
    """``render()``, stopped once it runs past ``seconds`` (``RENDER_SECONDS``) or its text is
    longer than the context could hold."""
    seconds = RENDER_SECONDS if seconds is None else seconds
    deadline = time.monotonic() + seconds

    def trace(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateLimitError(f"rendering took longer than {seconds:g} s")
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        text = render()
    except (RecursionError, MemoryError) as exc:
        raise TemplateLimitError(f"rendering failed: {type(exc).__name__}") from None
    finally:
        sys.settrace(previous)
    limit = MAX_CHARS_PER_TOKEN * max_model_len
    if len(text) > limit:
        raise TemplateLimitError(f"the rendered prompt is {len(text)} characters long, more than the context "
                                 f"({max_model_len} tokens) could hold (limit {limit})")
    return text
