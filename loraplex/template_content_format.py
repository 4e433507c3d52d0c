"""Which shape a chat template wants a message's ``content`` in: vLLM's
``--chat-template-content-format`` (``auto`` | ``string`` | ``openai``, default ``auto``).

- ``"string"``: the template uses ``message['content']`` as text (Llama 3's, ChatML's, SmolLM2's).
- ``"openai"``: the template loops over ``message['content']`` as a list of parts
  (``{"type": "text", "text": ...}``), as Gemma 3's, Llama 4's, Mistral 3's and Qwen2-VL's do.

``auto`` reads the template's Jinja syntax tree, as vLLM does (``_detect_content_format`` in
vllm/renderers/hf.py, formerly vllm/entrypoints/chat_utils.py): it is "openai" when some
``{% for x in M['content'] %}`` (or ``M.content``, through filters such as ``| selectattr(...)``
or a slice) loops over the content of a message ``M``, where ``M`` is the variable of a loop over
``messages`` or over a name ``{% set %}`` from it (``{% set loop_messages = messages[1:] %}``);
anything else, a template that does not parse included, is "string". The decision is made once
per template text and kept by a ``ContentFormatResolver`` (the server owns one; ``LLM`` another).

The detection code is loraplex's own; only the rule is vLLM's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Literal

from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

ContentFormat = Literal["string", "openai"]
CONTENT_FORMAT_OPTIONS = ("auto", "string", "openai")


class _GenerationTag(Extension):
    """Parses transformers' ``{% generation %}...{% endgeneration %}`` (assistant-mask templates
    use it) so such templates are read rather than refused; only its body matters here."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _parse(template: str) -> nodes.Template:
    # the environment transformers renders chat templates in, so what parses there parses here
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    return env.parse(template)


def _unwrap(node: nodes.Node) -> nodes.Node:
    """The value a filter, a test or a slice is applied to (``messages | reverse``,
    ``messages[1:]``): for what is looped over, they still name the same items."""
    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            return node


def _is_name(node: nodes.Node, names: set[str]) -> bool:
    node = _unwrap(node)
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names


def _is_content_of(node: nodes.Node, names: set[str]) -> bool:
    """``M['content']`` or ``M.content`` (maybe filtered or sliced) for a name ``M`` in ``names``."""
    node = _unwrap(node)
    if isinstance(node, nodes.Getattr):
        return node.attr == "content" and _is_name_exactly(node.node, names)
    if isinstance(node, nodes.Getitem):
        return (isinstance(node.arg, nodes.Const) and node.arg.value == "content"
                and _is_name_exactly(node.node, names))
    return False


def _is_name_exactly(node: nodes.Node, names: set[str]) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names


def _aliases_of_messages(tree: nodes.Template) -> set[str]:
    """``messages`` and every name set from it, directly or through another such name."""
    names = {"messages"}
    assigns = list(tree.find_all(nodes.Assign))
    grew = True
    while grew:
        grew = False
        for assign in assigns:
            target = assign.target
            if isinstance(target, nodes.Name) and target.name not in names and _is_name(assign.node, names):
                names.add(target.name)
                grew = True
    return names


def detect_content_format(template: str) -> ContentFormat:
    """``"openai"`` when the template loops over a message's content parts, else ``"string"``
    (also for a template that does not parse: rendering it will say what is wrong)."""
    try:
        tree = _parse(template)
    except Exception:  # any syntax the parser refuses: the default, as vLLM falls back
        return "string"
    loops = list(tree.find_all(nodes.For))
    message_aliases = _aliases_of_messages(tree)
    # loop variables over the messages; a tuple target (``for i, m in ...``) names no one message
    message_vars = {loop.target.name for loop in loops
                    if isinstance(loop.target, nodes.Name) and _is_name(loop.iter, message_aliases)}
    if any(_is_content_of(loop.iter, message_vars) for loop in loops):
        return "openai"
    return "string"


class ContentFormatResolver:
    """The content format for a chat template under one option (``auto``, ``string`` or
    ``openai``): a fixed option is returned as is; ``auto`` detects it once per template text and
    keeps the last ``max_templates`` answers (templates a request sends may be many)."""

    def __init__(self, option: str = "auto", max_templates: int = 32):
        if option not in CONTENT_FORMAT_OPTIONS:
            raise ValueError(f"chat template content format must be one of {', '.join(CONTENT_FORMAT_OPTIONS)}, "
                             f"got {option!r}")
        self.option = option
        self._max = max_templates
        self._detected: OrderedDict[str, ContentFormat] = OrderedDict()
        self._lock = threading.Lock()  # LLM.chat and the server's tokenizer thread may share one

    def format_for(self, template: str | None) -> ContentFormat:
        """The format ``template`` (its text; None: no template known) renders content in."""
        if self.option != "auto":
            return self.option  # type: ignore[return-value]
        if not template:
            return "string"
        with self._lock:
            found = self._detected.get(template)
            if found is not None:
                self._detected.move_to_end(template)
                return found
        found = detect_content_format(template)
        with self._lock:
            self._detected[template] = found
            while len(self._detected) > self._max:
                self._detected.popitem(last=False)
        return found

    def cached_templates(self) -> int:
        """How many template texts have a detected format kept (for tests and status)."""
        with self._lock:
            return len(self._detected)


def template_text(tokenizer, chat_template: str | None, tools: list | None) -> str | None:
    """The template text ``apply_chat_template(chat_template=..., tools=...)`` renders with:
    the given one (or, for a tokenizer with named templates, the one of that name), else the
    tokenizer's (its ``tool_use`` template when tools are sent and it has one). None when the
    tokenizer has none or cannot say."""
    getter = getattr(tokenizer, "get_chat_template", None)
    if getter is not None:
        try:
            return getter(chat_template, tools=tools)
        except Exception:  # no template, or a name it does not have: rendering reports that
            return None
    if chat_template is not None:
        return chat_template
    own = getattr(tokenizer, "chat_template", None)
    return own if isinstance(own, str) else None
