"""The SGLang ``/generate`` calls in flight, by tenant, for ``POST /abort_request``
(sglang_abort.py): each call's outputs object (sglang_routes ``_Outputs``), held weakly, so a call
is forgotten as soon as its response is done with it."""

from __future__ import annotations

import weakref


class SGLangCalls:
    """Calls in flight per tenant; a tenant only ever sees its own. Used on the event loop only."""

    def __init__(self):
        self._calls: dict[str, list[weakref.ref]] = {}

    def track(self, tenant: str, outputs) -> None:
        self._prune(tenant)
        self._calls.setdefault(tenant, []).append(weakref.ref(outputs))

    def live(self, tenant: str) -> list:
        """``tenant``'s calls with an output still running or queued."""
        self._prune(tenant)
        return [out for ref in self._calls.get(tenant, []) if (out := ref()) is not None]

    def _prune(self, tenant: str) -> None:
        refs = [ref for ref in self._calls.get(tenant, ()) if _running(ref())]
        if refs:
            self._calls[tenant] = refs
        else:
            self._calls.pop(tenant, None)


def _running(outputs) -> bool:
    return outputs is not None and any(state.finish is None for state in outputs.states)
