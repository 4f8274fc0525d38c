"""Small filesystem helpers: staging a model directory in shared memory, local copies."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)

SHM_ROOT = "/dev/shm"


def _shm_name(src: str) -> str:
    digest = hashlib.md5(os.path.abspath(src).encode()).hexdigest()[:12]
    return f"verl-{os.path.basename(os.path.normpath(src)) or 'model'}-{digest}"


def _dir_signature(path: str) -> list[tuple[str, int]]:
    out = []
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            out.append((os.path.relpath(p, path), os.path.getsize(p)))
    return sorted(out)


def copy_to_shm(path: str, shm_root: str = SHM_ROOT) -> str:
    """Copy the directory ``path`` into ``shm_root`` (RAM-backed on Linux) and return the copy's path.

    Loading a checkpoint from RAM is faster than from a network or spinning disk, which matters when several
    workers of one node read the same model. The copy is keyed by the source path; a copy whose file list and
    sizes already match is reused, so workers on one node copy only once. When ``shm_root`` does not exist
    (not Linux) or has too little room, the original path is returned and a warning is logged.
    """
    src = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(src):
        return src  # nothing to stage; the caller reports a missing model directory
    if src.startswith(os.path.abspath(shm_root) + os.sep):
        return src
    if not os.path.isdir(shm_root):
        logger.warning("use_shm: %s does not exist; loading %s in place", shm_root, src)
        return src
    dst = os.path.join(shm_root, _shm_name(src))
    want = _dir_signature(src)
    if os.path.isdir(dst) and _dir_signature(dst) == want:
        return dst
    need = sum(size for _, size in want)
    free = shutil.disk_usage(shm_root).free
    if need > free:
        logger.warning("use_shm: %s needs %.1f GiB but %s has %.1f GiB free; loading in place", src,
                       need / 2**30, shm_root, free / 2**30)
        return src
    tmp = tempfile.mkdtemp(prefix=os.path.basename(dst) + ".tmp", dir=shm_root)
    try:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        try:
            if os.path.isdir(dst):
                shutil.rmtree(dst, ignore_errors=True)
            os.rename(tmp, dst)
        except OSError:
            # Another worker of this node finished first: use its copy.
            if not (os.path.isdir(dst) and _dir_signature(dst) == want):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("use_shm: copied %s to %s", src, dst)
    return dst


def copy_to_local(path: str, use_shm: bool = False) -> str:
    """A local path for ``path`` (only local paths are supported); staged in /dev/shm when ``use_shm``."""
    local = os.path.abspath(os.path.expanduser(str(path)))
    return copy_to_shm(local) if use_shm else local
