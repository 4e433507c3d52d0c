"""Server-wide defaults a parsed OpenAI request takes where it says nothing: vLLM's
``--response-role`` and ``--return-tokens-as-token-ids``."""

from __future__ import annotations

from loraplex.config import Settings
from loraplex.server.protocol import GenerationRequest


def apply_server_defaults(req: GenerationRequest, settings: Settings) -> None:
    """A request's own ``return_tokens_as_token_ids`` wins over the server's. A chat answer's role
    is the server's ``response_role`` when the prompt asks for a reply (``add_generation_prompt``,
    the default); otherwise the answer continues the last message, and takes its role (vLLM's rule)."""
    if req.return_tokens_as_token_ids is None:
        req.return_tokens_as_token_ids = settings.return_tokens_as_token_ids
    if req.kind == "chat":
        if req.prompt_options.add_generation_prompt or not req.messages:
            req.response_role = settings.response_role
        else:
            req.response_role = req.messages[-1]["role"]
