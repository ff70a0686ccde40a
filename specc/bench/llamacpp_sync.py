"""llama.cpp through the llama-cpp-py-sync wheel: CFFI bindings over a prebuilt CPU libllama, so the
llama.cpp baseline installs in seconds instead of compiling llama.cpp.

`SyncLlama` has the part of llama-cpp-python's `Llama` that specc's benchmarks use: `reset`,
`generate` (greedy only, with the same `draft_model` hook: the drafted tokens are evaluated in one
batch behind the last token and the longest prefix the target agrees with is kept, plus the
target's own next token), `eval` and `scores`. `PromptLookup` drafts as llama-cpp-python's prompt
lookup does. Unlike llama-cpp-python with `logits_all`, logits are computed only where they are
read (the last prompt token and the drafted positions), so a speculative target prefills as fast
as a target-only one.

The wheel's libggml-cpu is one build for every x86-64 CPU (`system_info()` lists what it uses),
not tuned to the CPU it runs on as a from-source llama-cpp-python build is.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np

from ..errors import SpeccError

# import names of the bindings, in order of preference: a from-source llama-cpp-python is built for this CPU
MODULES = {"llama-cpp-python": "llama_cpp", "llama-cpp-py-sync": "llama_cpp_py_sync"}
INSTALL = ("pip install 'specc[llamacpp]' (llama-cpp-py-sync, a prebuilt CPU wheel) or pip install "
           "'specc[llamacpp-native]' (llama-cpp-python, builds llama.cpp from source: cmake, a C++ compiler, minutes)")
N_BATCH = 512  # llama-cpp-python's default n_batch and n_ubatch, so both bindings prefill in the same pieces


def binding(why: str = "a llama.cpp comparison") -> str:
    """The llama.cpp binding specc uses here (a key of MODULES), or one SpeccError saying how to install one."""
    for name, module in MODULES.items():
        if importlib.util.find_spec(module) is not None:
            return name
    raise SpeccError(f"{why} needs a llama.cpp binding and none is installed: {INSTALL}")


_LOADED: tuple | None = None
_LOG = None  # the log callback, kept alive while llama.cpp may call it


def library():
    """(ffi, lib): the wheel's CFFI declarations and its libllama, loaded and initialised once."""
    global _LOADED, _LOG
    if _LOADED is not None:
        return _LOADED
    try:
        from llama_cpp_py_sync import _cffi_bindings as bindings
    except ImportError as exc:
        raise SpeccError(f"llama-cpp-py-sync cannot be imported ({exc}): {INSTALL}") from None
    ffi = bindings.get_ffi()
    try:
        lib = bindings.get_lib()
    except RuntimeError as exc:
        if "GLIBC_2.38" not in str(exc):
            raise SpeccError(f"llama-cpp-py-sync's libllama does not load: {exc}") from None
        lib = ffi.dlopen(str(glibc_compat_copy(Path(bindings.__file__).parent) / "libllama.so"))
    lib.llama_backend_init()

    def log(level, text, _data):
        if level == 4:  # GGML_LOG_LEVEL_ERROR: why a model or context failed; the rest is progress chatter
            sys.stderr.write(ffi.string(text).decode("utf-8", "replace"))

    _LOG = ffi.callback("ggml_log_callback", log)
    lib.llama_log_set(_LOG, ffi.NULL)
    _LOADED = ffi, lib
    return _LOADED


def system_info() -> str:
    """llama.cpp's own summary of the CPU features its kernels were built to use."""
    ffi, lib = library()
    return ffi.string(lib.llama_print_system_info()).decode().strip()


def glibc_compat_copy(package: Path) -> Path:
    """A copy of the wheel's libraries that loads with glibc older than 2.38.

    The wheel is tagged manylinux2014 but was linked against glibc 2.38, whose headers turn strtol,
    strtoul, strtoull and sscanf into their C23 variants (__isoc23_*, which differ only in also reading
    0b-prefixed binary numbers). Those are its only glibc 2.38 symbols, so the copy binds them to the
    classic functions: each one's name points at the suffix of its own string (the classic name) and
    the GLIBC_2.38 version it requires is renamed to GLIBC_2.2.5. Made once per wheel, in specc's cache."""
    from ..models.cache import cache_dir

    libs = sorted(p for p in package.iterdir() if p.is_file() and ".so" in p.name)
    if not any(p.name == "libllama.so" for p in libs):
        raise SpeccError(f"llama-cpp-py-sync: no libllama.so in {package}")
    digest = hashlib.sha256(b"".join(p.name.encode() + hashlib.sha256(p.read_bytes()).digest() for p in libs))
    target = cache_dir("llama-cpp-py-sync") / f"glibc-compat-{digest.hexdigest()[:16]}"
    if (target / "libllama.so").is_file():
        return target
    work = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        for p in libs:
            (work / p.name).write_bytes(_bind_c23_to_classic(bytearray(p.read_bytes()), p.name))
        (work / "README").write_text(f"{package}'s libraries, their glibc 2.38 C23 symbols bound to the classic ones "
                                     "(specc.bench.llamacpp_sync.glibc_compat_copy)\n")
        try:
            work.rename(target)
        except OSError:  # another process made it first
            if not (target / "libllama.so").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


C23_PREFIX = b"__isoc23_"
SHT_DYNSYM, SHT_GNU_VERNEED, SHT_GNU_VERSYM = 11, 0x6FFFFFFE, 0x6FFFFFFF


def _elf_hash(name: bytes) -> int:
    h = 0
    for c in name:
        h = ((h << 4) + c) & 0xFFFFFFFF
        high = h & 0xF0000000
        h = (h ^ (high >> 24)) & ~high & 0xFFFFFFFF
    return h


def _bind_c23_to_classic(data: bytearray, name: str) -> bytearray:
    """The shared library `data` with its GLIBC_2.38 requirement renamed to GLIBC_2.2.5 and each symbol
    bound to it (all __isoc23_* functions) renamed to the classic function; unchanged without one."""
    def fail(why: str):
        return SpeccError(f"llama-cpp-py-sync's {name} needs glibc 2.38 and cannot be adapted to this system's glibc "
                          f"({why}); use a system with glibc >= 2.38 or llama-cpp-python (pip install 'specc[llamacpp-native]')")

    if data[:6] != b"\x7fELF\x02\x01":
        raise fail("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    by_type = {s[1]: s for s in sections}
    if SHT_GNU_VERNEED not in by_type:
        return data
    verneed = by_type[SHT_GNU_VERNEED]
    strtab = sections[verneed[6]]
    dynstr = bytes(data[strtab[4]:strtab[4] + strtab[5]])

    def string(offset: int) -> bytes:
        return dynstr[offset:dynstr.index(b"\0", offset)]

    classic = b"GLIBC_2.2.5"
    renamed = set()
    offset = verneed[4]
    while True:
        _, count, file, aux, following = struct.unpack_from("<HHIII", data, offset)
        entry = offset + aux
        for _ in range(count):
            _, flags, index, version, after = struct.unpack_from("<IHHII", data, entry)
            if string(file) == b"libc.so.6" and string(version) == b"GLIBC_2.38":
                if classic + b"\0" not in dynstr:
                    raise fail("no GLIBC_2.2.5 string to reuse")
                struct.pack_into("<IHHII", data, entry, _elf_hash(classic), flags, index, dynstr.index(classic + b"\0"), after)
                renamed.add(index)
            entry += after
        if not following:
            break
        offset += following
    if not renamed:
        return data
    dynsym, versym = by_type[SHT_DYNSYM], by_type[SHT_GNU_VERSYM]
    for i in range(dynsym[5] // dynsym[9]):
        version, = struct.unpack_from("<H", data, versym[4] + 2 * i)
        if version & 0x7FFF not in renamed:
            continue
        at = dynsym[4] + i * dynsym[9]
        symbol, = struct.unpack_from("<I", data, at)
        if not string(symbol).startswith(C23_PREFIX):
            raise fail(f"it also needs {string(symbol).decode()} from glibc 2.38")
        struct.pack_into("<I", data, at, symbol + len(C23_PREFIX))
    return data


class SyncLlama:
    """One GGUF model and one context (a single sequence) on the CPU, greedy; see the module docstring."""

    def __init__(self, gguf: str | Path, n_ctx: int, threads: int, logits_all: bool = False, flash_attn: bool = False):
        """`flash_attn` off by default, as llama-cpp-python's `Llama` has it, so both bindings run the same graph."""
        self.ffi, self.lib = ffi, lib = library()
        self.model = self.ctx = self.batch = None
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        # llama.cpp's AMX buffer type crashes where a virtual machine reports AMX without granting tile
        # state (bench/llamacpp.py); without it llama.cpp still repacks what its CPU_REPACK buffer takes
        amx = "AMX" in system_info() and os.environ.get("SPECC_LLAMACPP_EXTRA_BUFFERS", "0") != "1"
        if amx:
            params.use_extra_bufts = False
        self.specc_repacked = "none (AMX build: extra buffer types off)" if amx else "llama.cpp's choice"
        self.model = lib.llama_model_load_from_file(str(gguf).encode(), params)
        if self.model == ffi.NULL:
            raise SpeccError(f"llama.cpp could not load {gguf} (not a GGUF model it supports?)")
        ctx = lib.llama_context_default_params()
        ctx.n_ctx, ctx.n_batch, ctx.n_ubatch, ctx.n_seq_max = n_ctx, N_BATCH, N_BATCH, 1
        ctx.n_threads = ctx.n_threads_batch = threads
        ctx.flash_attn_type = 1 if flash_attn else 0
        ctx.embeddings, ctx.no_perf = False, False
        self.ctx = lib.llama_init_from_model(self.model, ctx)
        if self.ctx == ffi.NULL:
            raise SpeccError(f"llama.cpp could not make a {n_ctx}-token context for {gguf}")
        self.n_ctx, self.threads, self.logits_all, self.flash_attn = n_ctx, threads, logits_all, flash_attn
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.batch = lib.llama_batch_init(N_BATCH, 0, 1)
        for i in range(N_BATCH):  # every token belongs to sequence 0
            self.batch.n_seq_id[i] = 1
            self.batch.seq_id[i][0] = 0
        self.draft_model = None  # llama-cpp-python's hook: a callable from all token ids so far to drafted ids
        self.cached: list[int] = []  # the token ids in the KV cache, in position order
        self._scores: list = []

    def close(self) -> None:
        lib = getattr(self, "lib", None)
        if lib is None:
            return
        if self.batch is not None:
            lib.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx is not None:
            lib.llama_free(self.ctx)
            self.ctx = None
        if self.model is not None:
            lib.llama_model_free(self.model)
            self.model = None

    __del__ = close

    def reset(self) -> None:
        """Empty the KV cache (the next evaluation starts at position 0) and the timings."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        self.lib.llama_perf_context_reset(self.ctx)
        self.cached = []
        self._scores = []

    @property
    def n_tokens(self) -> int:
        return len(self.cached)

    def _decode(self, tokens: list[int], first_output: int):
        """Evaluate `tokens` after the cached ones, in batches of N_BATCH; the logits [n, vocab] of
        tokens[first_output:]."""
        ffi = self.ffi
        if self.n_tokens + len(tokens) > self.n_ctx:
            raise SpeccError(f"llama.cpp context of {self.n_ctx} tokens is too small for {self.n_tokens + len(tokens)}")
        rows = []
        for start in range(0, len(tokens), N_BATCH):
            chunk = np.asarray(tokens[start:start + N_BATCH], dtype=np.int32)
            n = len(chunk)
            positions = np.arange(self.n_tokens, self.n_tokens + n, dtype=np.int32)
            outputs = (np.arange(start, start + n) >= first_output).astype(np.int8)
            self.batch.n_tokens = n
            ffi.memmove(self.batch.token, chunk.tobytes(), 4 * n)
            ffi.memmove(self.batch.pos, positions.tobytes(), 4 * n)
            ffi.memmove(self.batch.logits, outputs.tobytes(), n)
            code = self.lib.llama_decode(self.ctx, self.batch)
            if code != 0:
                raise SpeccError(f"llama_decode failed with code {code} at position {self.n_tokens}")
            self.cached += chunk.tolist()
            k = int(outputs.sum())
            if k:
                logits = self.lib.llama_get_logits(self.ctx)  # the outputs' rows, in batch order
                rows.append(np.frombuffer(ffi.buffer(logits, 4 * k * self.n_vocab), np.float32).reshape(k, self.n_vocab).copy())
        return np.concatenate(rows) if rows else np.zeros((0, self.n_vocab), np.float32)

    def _truncate(self, n: int) -> None:
        """Drop cached positions n and later (rejected drafts)."""
        if n < self.n_tokens:
            if not self.lib.llama_memory_seq_rm(self.lib.llama_get_memory(self.ctx), 0, n, -1):
                raise SpeccError("llama.cpp could not remove tokens from its KV cache")
            del self.cached[n:]

    def eval(self, tokens: list[int]) -> None:
        """Evaluate `tokens` after the cached ones; with logits_all, every position's logits go to `scores`."""
        tokens = list(tokens)
        rows = self._decode(tokens, 0 if self.logits_all else len(tokens) - 1)
        self._scores.append(rows)

    @property
    def scores(self):
        """Logits [positions, vocab] of what `eval` evaluated since the last reset."""
        return np.concatenate(self._scores) if self._scores else np.zeros((0, self.n_vocab), np.float32)

    def generate(self, tokens: list[int], top_k: int = 1, temp: float = 0.0, reset: bool = True, **_sampling):
        """Greedy continuation of `tokens`, one token per iteration, until the caller stops; speculative
        through `draft_model` when set. As in llama-cpp-python, the cached tokens that begin `tokens` are
        kept (all but the last, whose logits are needed; `reset()` first to time a whole prefill). Other
        sampling arguments are accepted as llama-cpp-python's `generate` takes them and ignored: greedy
        decoding does not read them."""
        if temp > 0 and top_k != 1:
            raise SpeccError("SyncLlama generates greedily only (temp=0 or top_k=1)")
        if not reset:
            raise SpeccError("SyncLlama.generate continues from the cached tokens that begin `tokens` only (reset=True)")
        context = [int(t) for t in tokens]
        if not context:
            raise SpeccError("llama.cpp generation needs at least one prompt token")
        common = 0
        for cached, wanted in zip(self.cached, context[:-1]):
            if cached != wanted:
                break
            common += 1
        self._truncate(common)
        self._scores = []
        pending, prompt = context[common:], True
        while True:
            drafts = []
            if self.draft_model is not None and not prompt:  # drafting starts after the first generated token
                room = self.n_ctx - len(context)  # the pending token takes the last free position before them
                drafts = [int(t) for t in self.draft_model(np.asarray(context, dtype=np.intc))][:max(room, 0)]
            rows, prompt = self._decode(pending + drafts, len(pending) - 1), False
            for j, best in enumerate(rows.argmax(-1).tolist()):
                yield best
                if j < len(drafts) and best == drafts[j]:
                    context.append(best)  # already in the KV cache
                    continue
                self._truncate(len(context))  # the drafts after the first rejected one
                context.append(best)
                pending = [best]
                break

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """The GGUF vocabulary's token ids of `text` (as llama-cpp-python's `tokenize`)."""
        vocab, size = self.lib.llama_model_get_vocab(self.model), len(text) + 8
        out = self.ffi.new("llama_token[]", size)
        n = self.lib.llama_tokenize(vocab, text, len(text), out, size, add_bos, special)
        return list(out[0:n])

    def detokenize(self, tokens: list[int]) -> bytes:
        """The bytes of `tokens`' pieces, special tokens included (as llama-cpp-python's `detokenize`)."""
        vocab, buf, out = self.lib.llama_model_get_vocab(self.model), self.ffi.new("char[]", 256), b""
        for t in tokens:
            n = self.lib.llama_token_to_piece(vocab, int(t), buf, 256, 0, True)
            out += self.ffi.buffer(buf, max(n, 0))[:]
        return out

    def perf(self) -> dict:
        """llama.cpp's own timings since the last reset: prompt (batched) and generation (one-token) evaluations."""
        data = self.lib.llama_perf_context(self.ctx)
        return {"prompt_ms": data.t_p_eval_ms, "prompt_tokens": data.n_p_eval, "eval_ms": data.t_eval_ms,
                "eval_tokens": data.n_eval}


class PromptLookup:
    """Drafts the tokens that followed the earliest earlier occurrence of the context's last `max_ngram_size`
    tokens (then of fewer), up to `num_pred_tokens`; llama-cpp-python's prompt lookup drafts the same way."""

    def __init__(self, max_ngram_size: int = 2, num_pred_tokens: int = 10):
        self.max_ngram_size, self.num_pred_tokens = max_ngram_size, num_pred_tokens

    def __call__(self, input_ids, /, **_kwargs):
        import numpy as np

        ids = np.asarray(input_ids, dtype=np.intc)
        for n in range(min(self.max_ngram_size, len(ids) - 1), 0, -1):
            windows = np.lib.stride_tricks.sliding_window_view(ids, n)[:-1]  # the ones with a token after them
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if hits.size:
                start = hits[0] + n
                return ids[start:start + self.num_pred_tokens]
        return np.zeros(0, dtype=np.intc)
