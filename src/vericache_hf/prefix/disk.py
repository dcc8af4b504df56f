"""`DiskStore`: prefix chunks as files in a local directory, bounded in size, least recently read evicted first.

Each entry is one file, named by the sha256 of its full key, under `<path>/<namespace>/<2 hex>/`. Files are written
to a temporary file in the same directory and moved into place with `os.replace`, which is atomic: two processes
writing the same prefix, or a reader during a write, see either the old file or the new one, never a mix. A read
stamps the file's times with `os.utime`, and after each write the directory is scanned and the oldest-stamped files
are removed until the total is at most `max_bytes` (the scan sees every process's files, so the bound holds across
processes sharing the directory).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
import warnings
from collections.abc import Iterable
from pathlib import Path

from ..checks import check_int
from .store import PrefixStore, check_bytes

__all__ = ["DiskStore"]

_TEMP_PREFIX = ".tmp-"
_STALE_TEMP_S = 3600.0  # a temporary file this old was left by a writer that died


def _touch(path: Path) -> None:
    """Stamp `path` with the precise current time (the kernel's own stamp is coarse, a few ms)."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))


class DiskStore(PrefixStore):
    """A directory of prefix chunks: `path` (created if missing), at most `max_bytes` in all (default 8 GiB)."""

    def __init__(
        self,
        path: str | os.PathLike = "~/.cache/vericache_hf/prefixes",
        max_bytes: int = 8 << 30,
        namespace: str = "default",
    ) -> None:
        super().__init__(namespace)
        check_int("max_bytes", max_bytes, why=" (bytes)")
        self.root = Path(path).expanduser()
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)

    def _file(self, key: str) -> Path:
        name = hashlib.sha256(self.full_key(key).encode()).hexdigest()
        return self.root / self.namespace / name[:2] / name

    def get(self, key: str) -> bytes | None:
        path = self._file(key)
        try:
            value = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            warnings.warn(f"vericache DiskStore: reading {key!r} failed ({error}); a miss", stacklevel=2)
            return None
        with contextlib.suppress(OSError):  # evicted or replaced meanwhile: the bytes read are still whole
            _touch(path)  # the LRU clock: a read makes this entry the most recently used
        return value

    def exists(self, key: str) -> bool:
        return self._file(key).is_file()

    def delete(self, key: str) -> None:
        try:
            self._file(key).unlink(missing_ok=True)
        except OSError as error:
            warnings.warn(f"vericache DiskStore: deleting {key!r} failed ({error})", stacklevel=2)

    def put(self, key: str, value: bytes) -> None:
        self.put_many([(key, value)])

    def put_many(self, items: Iterable[tuple[str, bytes]]) -> None:
        try:
            for key, value in items:
                self._write(self._file(key), check_bytes(value))
        except OSError as error:
            warnings.warn(
                f"vericache DiskStore: writing under {self.root} failed ({error}); dropped", stacklevel=2
            )
        self.evict()

    @staticmethod
    def _write(path: Path, value: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(prefix=_TEMP_PREFIX, dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(value)
            _touch(Path(temp))
            os.replace(temp, path)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise

    def _entries(self) -> list[tuple[float, int, Path]]:
        """(last read or write time, size, path) of every entry under the root, all namespaces."""
        entries, now = [], time.time()
        for directory, _, files in os.walk(self.root):
            for name in files:
                path = Path(directory) / name
                try:
                    stat = path.stat()
                except OSError:
                    continue  # removed meanwhile
                if name.startswith(_TEMP_PREFIX):
                    if now - stat.st_mtime > _STALE_TEMP_S:
                        path.unlink(missing_ok=True)
                    continue
                entries.append((stat.st_mtime, stat.st_size, path))
        return entries

    def total_bytes(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def evict(self) -> int:
        """Remove least recently used entries until the directory holds at most `max_bytes`; the bytes freed."""
        entries = sorted(self._entries(), key=lambda entry: entry[0])
        total, freed = sum(size for _, size, _ in entries), 0
        for _, size, path in entries:
            if total - freed <= self.max_bytes:
                break
            try:
                path.unlink(missing_ok=True)  # another process may have evicted it first
            except OSError as error:
                warnings.warn(f"vericache DiskStore: could not evict {path} ({error})", stacklevel=2)
                continue
            freed += size
        return freed
