"""Writing a bundle: files built in a hidden sibling directory, the manifest with every file's sha256 last,
then one rename into place."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from ..digest import sha256_of
from ..errors import SpeccError
from ..version import __version__

from .manifest import FORMAT, FORMAT_VERSION, MANIFEST, Manifest


def build_manifest(fields: dict, root: Path) -> dict:
    """The manifest's JSON form: format header, `fields`, and the file table of everything under root."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "specc_version": __version__, **fields,
            "files": hash_tree(root)}


def hash_tree(root: Path) -> dict[str, dict]:
    """{relative path: {sha256, bytes}} for every file under root except the manifest."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            out[path.relative_to(root).as_posix()] = {"sha256": sha256_of(path), "bytes": path.stat().st_size}
    return out


class BundleWriter:
    """Builds a bundle in a hidden sibling directory and moves it into place only when complete,
    so a failed compile never leaves a half bundle or destroys the previous one."""

    def __init__(self, output: Path):
        self.output = Path(output).resolve()
        if self.output.exists() and not self.output.is_dir():
            raise SpeccError(f"output {self.output} exists and is not a directory")
        if self.output.exists() and not (self.output / MANIFEST).is_file() and any(self.output.iterdir()):
            raise SpeccError(f"output {self.output} is a non-empty directory that is not a specc bundle; "
                             "choose another output (compile replaces only bundles)")
        try:
            self.output.parent.mkdir(parents=True, exist_ok=True)
            self.root = Path(tempfile.mkdtemp(prefix=f".{self.output.name}.partial-", dir=self.output.parent))
        except OSError as exc:
            raise SpeccError(f"cannot write the bundle to {self.output}: {exc.strerror or exc}") from None

    def graph_dir(self, role: str) -> Path:
        path = self.root / role
        path.mkdir(exist_ok=True)
        return path

    def finish(self, fields: dict) -> tuple[Path, Manifest]:
        """Write the manifest (checked by the reader) and move the bundle into place."""
        raw = build_manifest(fields, self.root)
        manifest = Manifest.from_dict(raw)
        (self.root / MANIFEST).write_text(json.dumps(raw, indent=2, allow_nan=False) + "\n")
        if self.output.exists():
            old = self.output.with_name(f".{self.output.name}.old-{os.getpid()}")
            self.output.rename(old)
            self.root.rename(self.output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            self.root.rename(self.output)
        return self.output, manifest

    def abort(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
