"""Where checkpoint folders live.

A plain path is a local folder: the engine writes checkpoints straight into it (atomically, via a
temporary sibling and a rename). Anything with a scheme (``file://``, ``s3://``, ``gs://``,
``memory://`` …) goes through fsspec: the engine writes into a local temporary folder and uploads it;
the database marks a checkpoint ready only after the upload, so a partial upload is never used.
"""

from __future__ import annotations

import posixpath
import shutil
from pathlib import Path
from typing import IO


class Storage:
    """A checkpoint root: ``uri_for`` names folders, the other methods move and read them."""

    def __init__(self, root: str | Path):
        root = str(root)
        self.root = root
        self.is_local = "://" not in root
        if self.is_local:
            self._root_path = Path(root).expanduser().resolve()
            self._root_path.mkdir(parents=True, exist_ok=True)
            self.fs = None
        else:
            import fsspec

            self.fs, self._fs_root = fsspec.core.url_to_fs(root)
            self.fs.makedirs(self._fs_root, exist_ok=True)

    def __repr__(self) -> str:
        return f"Storage({self.root!r})"

    def uri_for(self, *parts: str) -> str:
        """The URI of a folder below the root (``parts`` are already validated names)."""
        if self.is_local:
            return str(self._root_path.joinpath(*parts))
        return self.root.rstrip("/") + "/" + "/".join(parts)

    def _path(self, uri: str) -> str:
        if self.is_local:
            return uri
        return self.fs._strip_protocol(uri)  # type: ignore[union-attr]

    def local_path(self, uri: str) -> Path | None:
        """The folder itself when the root is local (engines write there directly), else None."""
        return Path(uri) if self.is_local else None

    def upload_dir(self, local: Path, uri: str) -> None:
        """Copy a local folder to ``uri`` (replacing what was there)."""
        if self.is_local:
            raise RuntimeError("local storage is written in place")
        path = self._path(uri)
        if self.fs.exists(path):  # type: ignore[union-attr]
            self.fs.rm(path, recursive=True)  # type: ignore[union-attr]
        self.fs.makedirs(path, exist_ok=True)  # type: ignore[union-attr]
        for f in sorted(Path(local).iterdir()):
            self.fs.put_file(str(f), posixpath.join(path, f.name))  # type: ignore[union-attr]

    def download_dir(self, uri: str, local: Path) -> Path:
        """Copy the folder at ``uri`` into ``local`` (created); returns ``local``."""
        local.mkdir(parents=True, exist_ok=True)
        for name, _size in self.list_files(uri):
            if self.is_local:
                shutil.copyfile(Path(uri) / name, local / name)
            else:
                self.fs.get_file(posixpath.join(self._path(uri), name), str(local / name))  # type: ignore[union-attr]
        return local

    def exists(self, uri: str) -> bool:
        if self.is_local:
            return Path(uri).is_dir()
        return bool(self.fs.exists(self._path(uri)))  # type: ignore[union-attr]

    def list_files(self, uri: str) -> list[tuple[str, int]]:
        """``(file name, size in bytes)`` of the files in a checkpoint folder."""
        if self.is_local:
            p = Path(uri)
            return sorted((f.name, f.stat().st_size) for f in p.iterdir() if f.is_file()) if p.is_dir() else []
        path = self._path(uri)
        if not self.fs.exists(path):  # type: ignore[union-attr]
            return []
        out = []
        for info in self.fs.ls(path, detail=True):  # type: ignore[union-attr]
            if info.get("type") == "file":
                out.append((posixpath.basename(info["name"]), int(info.get("size") or 0)))
        return sorted(out)

    def size(self, uri: str) -> int:
        return sum(size for _, size in self.list_files(uri))

    def open_file(self, uri: str, name: str) -> IO[bytes]:
        """Open one file of a checkpoint folder for reading."""
        if "/" in name or name.startswith("."):
            raise ValueError(f"bad file name {name!r}")
        if self.is_local:
            return open(Path(uri) / name, "rb")
        return self.fs.open(posixpath.join(self._path(uri), name), "rb")  # type: ignore[union-attr]

    def delete(self, uri: str) -> None:
        """Remove a checkpoint folder (no error if it is already gone)."""
        if self.is_local:
            shutil.rmtree(uri, ignore_errors=True)
        elif self.fs.exists(self._path(uri)):  # type: ignore[union-attr]
            self.fs.rm(self._path(uri), recursive=True)  # type: ignore[union-attr]
