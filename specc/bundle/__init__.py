"""Bundles: one self-describing directory holding the compiled graphs, tokenizer and manifest.

Layout::

    manifest.json      format, versions, recipe, per-graph I/O signature and ranges, sha256 of every file
    target/            the target's engine files
    draft/             the draft's engine files (absent for draft-free methods)
    tokenizer/         the tokenizer files

The manifest is read into a typed `Manifest` and validated in one place (`Manifest.from_dict`):
any missing field, wrong type or out-of-range value is one BundleError naming the field.

Trust model (docs/security.md):
- every file in the bundle is listed in `files` with its size and sha256; paths are relative,
  inside the bundle, without `..`, symlinks or special files; a file present but not listed is
  an error; each graph's `files` are exactly the listed files under its `dir`;
- every listed file is checked before any loader opens one (size always, sha256 unless
  verify=False);
- the bundle id is `sha256:` + sha256 of the canonical manifest (`canonical_json`: the whole
  parsed manifest, keys sorted, no whitespace, ASCII); it covers the file table, so pinning
  the id (`expect_id`) pins every byte the loaders read. Without a pinned id a rewritten
  manifest with consistent hashes is still a valid bundle: hashes detect corruption, the id
  detects substitution;
- backends that execute code from the bundle (AOTInductor shared objects, Torch-TensorRT
  programs) are refused unless the caller passes trust_code=True.
"""
from __future__ import annotations

from .manifest import MANIFEST, FileEntry, GraphEntry, Manifest, bundle_id, canonical_json, read_manifest
from .opening import Bundle, check_code_trust, check_files, open_bundle
from .writer import BundleWriter

__all__ = ["Bundle", "BundleWriter", "FileEntry", "GraphEntry", "Manifest", "MANIFEST", "bundle_id", "canonical_json",
           "check_code_trust", "check_files", "open_bundle", "read_manifest"]
