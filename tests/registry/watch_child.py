"""Child process for the cross-process hot-swap test.

Usage: python -m tests.registry.watch_child URL TENANT ADAPTER INTERVAL
Prints ``ready <version>`` once watching, then ``seen <version> <sha256> <unix time>`` each time
the watcher reports a change, resolving the adapter name afresh. Exits when stdin closes.
"""

from __future__ import annotations

import sys
import time

from loraplex.registry.service import RegistryService
from loraplex.registry.watch import RegistryWatcher


def main() -> None:
    url, tenant, adapter, interval = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    service = RegistryService.from_url(url)

    def on_change(_counter: int) -> None:
        version = service.resolve(tenant, adapter)
        print(f"seen {version.version} {version.sha256} {time.time():.6f}", flush=True)

    with RegistryWatcher(service, interval, on_change):
        print(f"ready {service.resolve(tenant, adapter).version}", flush=True)
        sys.stdin.read()  # until the parent closes our stdin


if __name__ == "__main__":
    main()
