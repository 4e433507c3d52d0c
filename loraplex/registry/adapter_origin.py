"""Who manages an adapter: the operator (admin API, CLI, ``serve --lora-modules``; ``origin``
None) or a tenant's runtime loads (vLLM's ``POST /v1/load_lora_adapter``;
``ADAPTER_ORIGIN_RUNTIME``).

The rule, applied inside the transaction that writes (so no check-then-write race):

* a runtime write (load in place, activate, unload) to an adapter the operator manages is
  refused with ``ManagedByOperator`` and changes nothing;
* a runtime load creates (or re-creates, after a delete) an adapter as a runtime one;
* an operator upload to a runtime adapter makes it the operator's from then on: its versions
  are no longer the tenant's to unload. Operator activates and deletes leave the origin alone.
"""

from __future__ import annotations

from loraplex.registry.errors import ManagedByOperator
from loraplex.registry.models import ADAPTER_ORIGIN_RUNTIME, Adapter


def refuse_unless_runtime(adapter: Adapter, origin: str | None) -> None:
    """``ManagedByOperator`` when a runtime write (``origin`` ``ADAPTER_ORIGIN_RUNTIME``) meets an
    adapter the operator manages."""
    if origin == ADAPTER_ORIGIN_RUNTIME and adapter.origin != ADAPTER_ORIGIN_RUNTIME:
        raise ManagedByOperator(
            f"adapter {adapter.name!r} was not loaded through /v1/load_lora_adapter: the operator manages "
            "it (admin API, `loraplex adapters`, or --lora-modules), and the runtime endpoints cannot "
            "change or unload it"
        )


def claim_for(adapter: Adapter, origin: str | None) -> None:
    """Before a new version is written to the live ``adapter`` by ``origin``: refuse a runtime
    write to the operator's adapter; an operator write makes the adapter the operator's."""
    refuse_unless_runtime(adapter, origin)
    if origin is None:
        adapter.origin = None
