"""Engine options under which exactness suites run: ORCA's reservation, and the paged policy with
small blocks (many boundaries), then with chunked prefill and prefix caching on top."""

from __future__ import annotations

from typing import Any

KV_MODES: dict[str, dict[str, Any]] = {
    "reserve": {"kv_policy": "reserve"},
    "paged": {"kv_policy": "paged", "block_size": 4},
    "paged-chunked-cached": {"kv_policy": "paged", "block_size": 4, "max_num_batched_tokens": 7,
                             "enable_prefix_caching": True},
}
