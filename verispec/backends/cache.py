"""Where verispec keeps what it fetches, converts, exports, compiles and measures: $VERISPEC_CACHE, else the user's
cache directory (``~/.cache/verispec`` on Linux)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "VERISPEC_CACHE"


def cache_dir() -> Path:
    """Where converted models live: $VERISPEC_CACHE, else the user's cache directory."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("verispec"))
