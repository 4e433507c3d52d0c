"""Child process for the cross-process usage test.

Usage: python -m tests.registry.usage_child URL BATCHES WHO
Waits for a line on stdin (so parent and children start writing together), then adds BATCHES
batches of usage to the same rows the other writers use, and prints ``done``.
"""

from __future__ import annotations

import sys

from loraplex.registry.service import RegistryService
from tests.registry.test_usage import writer_batch


def main() -> None:
    url, batches, who = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    service = RegistryService.from_url(url)
    print("ready", flush=True)
    sys.stdin.readline()
    for i in range(batches):
        service.record_usage(writer_batch(who, i))
    print("done", flush=True)


if __name__ == "__main__":
    main()
