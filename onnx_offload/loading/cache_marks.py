"""What in a cache folder is provably this package's, and the mark of the folder itself.

`onnx-offload cache clear` is given a folder by name, and a folder given by mistake (a home
folder, a project's) must lose nothing of the user's. So nothing is removed for its name
alone: an entry is a folder whose manifest (a regular file, see fingerprints.write_manifest)
names the folder's own key; a partial folder (an entry being made) and a folder an entry
was set aside into carry MARK, a file the package writes there first (a partial folder
named with its maker and still empty is the package's too: its maker was killed before
it marked it, and an empty folder holds nothing of anyone's); the cache folder
itself carries CACHEDIR.TAG (https://bford.info/cachedir/, which backup tools also read),
written only into a folder that holds nothing but the package's own.
"""
from __future__ import annotations

import errno
import json
import os
import re
import stat
from typing import List

from .files import CONFIG_BYTES, open_regular, read_range
from .fingerprints import MANIFEST, MARK

TAG = "CACHEDIR.TAG"
SIGNATURE = b"Signature: 8a477f597d28d172789f06886806bc55"
_TAG_TEXT = SIGNATURE + (b"\n# This file is a cache directory tag created by onnx-offload.\n"
                         b"# For information about cache directory tags, see https://bford.info/cachedir/\n")
_MARK_TEXT = b"onnx-offload: a cache folder of this package's, removed by `onnx-offload cache clear`\n"
PARTIAL = ".partial-"  # an entry being made, by the process its name names (see workdir.make_owned_dir)
STALE = ".stale-"  # an entry set aside (tempfile.mkdtemp's names)
ENTRY = re.compile(r"[0-9a-f]{24}$")  # a published entry is named by its key
_STALE = re.compile(r"\.stale-[0-9a-z_]{8}$")
_PRINT = re.compile(r"[0-9a-f]{64}$")  # a file's fingerprint in a manifest (fingerprints.fingerprint_fd)


def tagged(cache: str) -> bool:
    """Whether `cache` carries a CACHEDIR.TAG (a regular file that starts with the
    signature)."""
    try:
        fd = open_regular(os.path.join(cache, TAG), follow=False)
    except OSError:
        return False
    try:
        return os.pread(fd, len(SIGNATURE), 0) == SIGNATURE
    finally:
        os.close(fd)


def write_tag(cache: str) -> None:
    """Writes CACHEDIR.TAG into `cache` (0600; one already there is kept)."""
    try:
        fd = os.open(os.path.join(cache, TAG), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return
    try:
        with open(fd, "wb") as f:
            f.write(_TAG_TEXT)
    except BaseException:
        os.unlink(os.path.join(cache, TAG))  # a tag cut short (a full disk) is no tag
        raise


def adopt(cache: str) -> bool:
    """Tags `cache` where it holds nothing but the package's own (a new folder, or one an
    older version of the package filled without a tag); True when it carries the tag."""
    if tagged(cache):
        return True
    try:
        if foreign_names(cache):
            return False
        write_tag(cache)
    except OSError:
        return False  # a folder the package may read but not write: used untagged
    return tagged(cache)


def write_mark(folder: str) -> None:
    """Marks `folder`, just made by the package in the cache, as the package's."""
    fd = os.open(os.path.join(folder, MARK), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with open(fd, "wb") as f:
        f.write(_MARK_TEXT)


def marked(path: str) -> bool:
    """Whether `path` is a folder (no symbolic link) of this user's that carries MARK."""
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            return False
        os.close(open_regular(os.path.join(path, MARK), follow=False))
        return True
    except OSError:
        return False


def read_manifest(path: str):
    """The JSON value of the manifest of the folder `path` (no symbolic link, the manifest
    a regular file of at most CONFIG_BYTES); None where there is none or it cannot be read."""
    try:
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fd = open_regular(MANIFEST, dir_fd=dir_fd, follow=False)
    except OSError:
        return None
    finally:
        os.close(dir_fd)
    try:
        size = os.fstat(fd).st_size
        return json.loads(read_range(fd, 0, size, MANIFEST)) if size <= CONFIG_BYTES else None
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)


def is_entry(path: str, key: str = "") -> bool:
    """Whether `path` is a cache entry the package published: a folder (no symbolic link)
    whose manifest is of the package's layout and names the key `key` (by default the
    folder's own name, as a published entry is named). Entries of older versions, whose
    manifests lack `made_by`, are recognised by the key, or by the fingerprints of the
    first layout."""
    manifest = read_manifest(path)
    want = key or os.path.basename(path)
    if not isinstance(manifest, dict) or not ENTRY.match(want):
        return False
    if "key" not in manifest and manifest and all(isinstance(v, str) and _PRINT.match(v) for v in manifest.values()):
        # The first layout (before the key was recorded): the fingerprint of each of the
        # entry's files, by name; recognised where they are exactly the folder's files.
        try:
            return set(manifest) == set(os.listdir(path)) - {MANIFEST}
        except OSError:
            return False
    return (manifest.get("key") == want and isinstance(manifest.get("files"), dict)
            and isinstance(manifest.get("sources"), list))


def is_set_aside(path: str) -> bool:
    """Whether `path` is a folder an entry was set aside into: marked, or (by older
    versions) holding only an entry."""
    if not _STALE.match(os.path.basename(path)):
        return False
    if marked(path):
        return True
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        names = os.listdir(path)
    except OSError:
        return False
    inner = os.path.join(path, "entry")
    manifest = read_manifest(inner) if names == ["entry"] else None
    key = manifest.get("key") if isinstance(manifest, dict) else None
    return isinstance(key, str) and is_entry(inner, key)


def is_partial(path: str) -> bool:
    """Whether `path` is a partial folder the package made: named with its maker (see
    workdir.make_owned_dir) and marked, or still empty (its maker killed before it could
    mark it: an empty folder holds nothing of anyone's)."""
    from .workdir import owned_name
    if not owned_name(os.path.basename(path), PARTIAL):
        return False
    if marked(path):
        return True
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode) and not os.listdir(path)
    except OSError:
        return False


def foreign_names(cache: str) -> List[str]:
    """The names in `cache` that are not provably the package's, sorted."""
    try:
        names = os.listdir(cache)
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise OSError(errno.ENOTDIR, "not a folder", cache) from None
    foreign = []
    for name in names:
        path = os.path.join(cache, name)
        if name == TAG:
            ours = tagged(cache)
        elif name.startswith(STALE):
            ours = is_set_aside(path)
        elif name.startswith(PARTIAL):
            ours = is_partial(path)
        else:
            ours = is_entry(path)
        if not ours:
            foreign.append(name)
    return sorted(foreign)
