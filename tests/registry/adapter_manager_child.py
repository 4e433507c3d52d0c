"""Child process for the cross-process hot-swap test over PostgreSQL and S3 (moto).

Usage: python -m tests.registry.adapter_manager_child DB_URL BLOB_URL CACHE_DIR TENANT ADAPTER INTERVAL
(AWS settings come from the environment.) Builds its own AdapterManager; prints
``ready <version> <hash of its local files>`` once watching, then, on each registry change,
resolves the adapter afresh (fetching from the blob store) and prints
``seen <version> <registry sha256> <hash of its local files> <unix time>``. Exits when stdin closes.
"""

from __future__ import annotations

import sys
import time

from loraplex.lora.peft_format import compute_content_hash
from loraplex.lora.spec import LoRATargetSpec
from loraplex.registry.adapter_manager import AdapterManager
from loraplex.registry.service import RegistryService
from loraplex.registry.watch import RegistryWatcher
from loraplex.storage.base import open_blob_store


def main() -> None:
    db_url, blob_url, cache_dir, tenant, adapter, interval = sys.argv[1:7]
    service = RegistryService.from_url(db_url)
    spec = LoRATargetSpec(model_name="unused", num_layers=0, module_shapes={})  # resolve only
    manager = AdapterManager(
        service, open_blob_store(blob_url), AdapterManager.make_disk_cache(cache_dir, 1 << 30), spec, 64
    )

    def on_change(_counter: int) -> None:
        ref = manager.resolve(tenant, adapter)
        version = ref.name.split("@")[1]
        print(f"seen {version} {ref.content_hash} {compute_content_hash(ref.path)} {time.time():.6f}", flush=True)

    with RegistryWatcher(service, float(interval), on_change):
        ref = manager.resolve(tenant, adapter)
        print(f"ready {ref.name.split('@')[1]} {compute_content_hash(ref.path)}", flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
