"""The cache folder that ONNX_OFFLOAD_CACHE_DIR names, checked before it is made.

A variable set once in a shell profile and read by every session of every working
folder is easy to mistype and hard to see: a relative name makes a folder wherever the
program runs, and a mistyped path would make a tree of folders. So a folder the variable
names is made only where the folder above it exists, and a relative one with a warning
that says where it resolved. A folder given as a keyword or a flag is the caller's
explicit choice, made as named (cache.cache_folder).
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

from ..config import ENV_CACHE_DIR, env_is_set, parse_cache_dir


def named_by_env(cache_dir: Optional[str]) -> bool:
    """Whether `cache_dir` (a configuration's) is the folder ONNX_OFFLOAD_CACHE_DIR names."""
    if not cache_dir or cache_dir in ("auto", "off") or not env_is_set(ENV_CACHE_DIR):
        return False
    try:
        return parse_cache_dir(os.environ[ENV_CACHE_DIR]) == cache_dir
    except ValueError:
        return False


def check_env_cache_dir(cache_dir: str) -> Tuple[bool, str]:
    """(whether the cache folder the variable names may be used, what to warn about).
    A folder that exists is used as it is; one that does not is made only where its
    parent exists."""
    if os.path.lexists(cache_dir):
        return True, ""
    where = os.path.abspath(cache_dir)
    parent = os.path.dirname(where)
    named = f"{ENV_CACHE_DIR}={os.environ[ENV_CACHE_DIR]!r}"
    if not os.path.isabs(cache_dir):
        named += f", relative to the working folder, is {where}"
    if not os.path.isdir(parent):
        return False, (f"{named}, whose parent folder {parent} does not exist: the cache is not used and "
                       f"nothing is made (make {parent}, or name a folder whose parent exists)")
    if not os.path.isabs(cache_dir):
        return True, (f"{named}: the cache folder is made there (an absolute path names one folder whatever "
                      f"the working folder)")
    return True, ""
