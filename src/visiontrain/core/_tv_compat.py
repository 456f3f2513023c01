"""Make a CUDA build of torchvision usable with a CPU-only torch.

PyPI may only carry a CUDA wheel of torchvision.  Its ``_C.so``/``image.so`` link
against ``libc10_cuda.so``/``libtorch_cuda.so``, which CPU torch lacks, so
``import torchvision`` fails ("operator torchvision::nms does not exist").  The
symbols they import from those libraries are device/stream/allocator helpers that
CPU kernels never call.  :func:`ensure_torchvision` reads the missing symbol names
from the installed ``.so`` files (ELF ``.dynsym``), compiles two tiny stand-in
libraries whose functions ``abort()`` with a message if ever called, caches them
per user, preloads them (plus the bundled CUDA runtime) with ``RTLD_GLOBAL`` and
then imports torchvision.  Call it before anything imports torchvision or timm.
"""
from __future__ import annotations

import contextlib
import ctypes, hashlib, importlib.util, logging, os, platform, re, shutil, struct
import subprocess, sys, tempfile, threading
from pathlib import Path

__all__ = ["ensure_torchvision", "state"]
log = logging.getLogger("visiontrain")
STUB_LIBS = ("libc10_cuda.so", "libtorch_cuda.so")
_FORMAT = "1"  # bump when the generated code changes
_lock = threading.Lock()
#: What the last call did: mode ("native"/"stubbed"), compiled (bool), lib_dir, symbols.
state: dict = {"mode": None, "compiled": False, "lib_dir": None, "symbols": 0}


def _elf(path: Path):
    """Return (NEEDED names, [(name, st_type)] of undefined GLOBAL symbols); ELF64 LE."""
    d = path.read_bytes()
    if d[:4] != b"\x7fELF" or d[4] != 2 or d[5] != 1:
        raise RuntimeError(f"{path}: not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", d, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", d, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", d, shoff + i * shentsize) for i in range(shnum)]
    cstr = lambda base, o: d[base + o:d.index(b"\0", base + o)].decode()
    needed, undef = [], []
    for _n, typ, _f, _a, off, size, link, _i, _al, _es in secs:
        strtab = secs[link][4]
        if typ == 6:  # SHT_DYNAMIC: (d_tag, d_val) pairs, DT_NEEDED == 1
            needed += [cstr(strtab, v) for t, v in struct.iter_unpack("<qQ", d[off:off + size]) if t == 1]
        elif typ == 11:  # SHT_DYNSYM: Elf64_Sym, 24 bytes; skip entry 0
            for name, info, _o, shndx, _v, _s in struct.iter_unpack("<IBBHQQ", d[off + 24:off + size]):
                if shndx == 0 and info >> 4 == 1:  # SHN_UNDEF, STB_GLOBAL (weak refs are fine)
                    undef.append((cstr(strtab, name), info & 0xF))
    return needed, undef


def _missing_symbols(sos, search_dirs):
    """Undefined symbols of ``sos`` that no loadable dependency (or the process) defines."""
    handles, undef = [ctypes.CDLL(None)], {}
    for so in sos:
        needed, syms = _elf(so)
        undef.update(syms)
        for name in needed:
            if name in STUB_LIBS:
                continue
            for cand in [str(p / name) for p in (so.parent, *search_dirs) if (p / name).exists()] + [name]:
                with contextlib.suppress(OSError):
                    handles.append(ctypes.CDLL(cand, mode=ctypes.RTLD_GLOBAL))
                    break
            else:
                raise RuntimeError(f"{so.name} needs {name}, which cannot be found; stubs cannot fix that")

    def defined(sym):
        for h in handles:
            with contextlib.suppress(AttributeError):
                return bool(h[sym])  # dlsym; searches h and its dependencies
        return False
    return {s: t for s, t in undef.items() if not defined(s)}


def _c_source(symbols) -> str:
    out = ["#include <stdio.h>\n#include <stdlib.h>",
           "static void vt_die(const char *s) { fprintf(stderr, \"visiontrain: CUDA stub %s called, "
           "but torch is a CPU-only build (see visiontrain.core._tv_compat)\\n\", s); abort(); }"]
    for i, (sym, typ) in enumerate(sorted(symbols.items())):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", sym):
            raise RuntimeError(f"cannot stub symbol with unusual name {sym!r}")
        if typ in (1, 6):  # STT_OBJECT / STT_TLS: zero-filled data, generously sized
            tls = "__thread " if typ == 6 else ""
            out.append(f'{tls}__attribute__((aligned(64))) char vt_d{i}[256] __asm__("{sym}") = {{0}};')
        else:  # STT_FUNC / NOTYPE: abort loudly if ever called
            out.append(f'void vt_f{i}(void) __asm__("{sym}");\nvoid vt_f{i}(void) {{ vt_die("{sym}"); }}')
    return "\n".join(out) + "\n"


def _cache_root() -> Path:
    base = os.environ.get("VISIONTRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "visiontrain")
    return Path(base) / "tv_cuda_stubs"


def _build(final: Path, sos, search_dirs) -> int:
    """Compile the stub libraries into ``final``, atomically (temp dir + os.replace)."""
    cc = next((shutil.which(c) for c in ([os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"])
               if shutil.which(c)), None)
    if cc is None:
        raise RuntimeError(
            "torchvision is a CUDA build but torch is CPU-only, and no C compiler (cc/gcc/clang or $CC) was found "
            "to build the CUDA stub libraries. Either install gcc (e.g. `apt-get install gcc`) or install a CPU "
            "build of torchvision matching torch (pip install torchvision --index-url "
            "https://download.pytorch.org/whl/cpu).")
    missing = _missing_symbols(sos, search_dirs)
    split = {lib: {s: t for s, t in missing.items() if s.startswith(("_ZN3c10", "_ZNK3c10")) == (lib == STUB_LIBS[0])}
             for lib in STUB_LIBS}
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    try:
        for lib, syms in split.items():
            src = tmp / (lib[:-3] + ".c")
            src.write_text(_c_source(syms))
            r = subprocess.run([cc, "-shared", "-fPIC", "-O1", f"-Wl,-soname,{lib}", "-o", str(tmp / lib), str(src)],
                               capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"compiling CUDA stubs with {cc} failed:\n{r.stderr}")
        (tmp / "symbols.txt").write_text("".join(f"{s}\n" for s in sorted(missing)))
        try:
            os.replace(tmp, final)
        except OSError:  # another process won the race; its build is equivalent
            if not (final / STUB_LIBS[1]).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return len(missing)


def _tv_ops_ok() -> bool:
    import torch
    return torch._C._dispatch_has_kernel("torchvision::nms") if hasattr(torch._C, "_dispatch_has_kernel") \
        else hasattr(torch.ops.torchvision, "nms")


def ensure_torchvision() -> str:
    """Import torchvision with working native ops; return "native" or "stubbed" (see module doc).

    Idempotent and thread-safe; later calls in the process (and in fork()ed children) return at once.
    """
    with _lock:
        if state["mode"]:
            return state["mode"]
        import torch
        if any(m == "torchvision" or m.startswith("torchvision.") for m in sys.modules):
            if "torchvision" in sys.modules and _tv_ops_ok():
                state["mode"] = "native"
                return "native"
            raise RuntimeError("torchvision was imported (and failed to load its native ops) before "
                               "visiontrain.core._tv_compat.ensure_torchvision() ran. ensure_torchvision() must run "
                               "before anything imports torchvision or timm; call it first, in a fresh process.")
        spec = importlib.util.find_spec("torchvision")
        tv_dir = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
        if torch.version.cuda is None and tv_dir is not None and (tv_dir / "_C.so").exists():
            try:
                ctypes.CDLL(str(tv_dir / "_C.so"))  # loads (and is reused by torchvision) unless CUDA libs missing
            except OSError as e:
                return _stub_and_import(torch, tv_dir, e)
        import torchvision  # noqa: F401  (native build, or a problem stubs cannot fix)
        state["mode"] = "native"
        return "native"


def _stub_and_import(torch, tv_dir: Path, load_error: OSError) -> str:
    so = tv_dir / "_C.so"
    sos = [p for p in (so, tv_dir / "image.so") if p.exists()]
    search_dirs = [d for d in (tv_dir.parent / "torchvision.libs", Path(torch.__file__).parent / "lib",
                               tv_dir.parent / "nvidia" / "cuda_runtime" / "lib") if d.is_dir()]
    for d in search_dirs:  # the CUDA runtime the wheel bundles (its SONAME is libcudart.so.NN)
        for rt in sorted(d.glob("libcudart*.so*")):
            ctypes.CDLL(str(rt), mode=ctypes.RTLD_GLOBAL)
    ver = tv_dir / "version.py"  # torchvision's version, read without importing it
    key = "|".join([_FORMAT, torch.__version__, str(tv_dir), platform.machine(),
                    ver.read_text(errors="replace") if ver.exists() else "",
                    *(f"{p.name}:{p.stat().st_size}" for p in sos)])
    final = _cache_root() / hashlib.sha256(key.encode()).hexdigest()[:16]
    compiled = not (final / STUB_LIBS[1]).exists()
    n = _build(final, sos, search_dirs) if compiled else len((final / "symbols.txt").read_text().split())
    for lib in STUB_LIBS:
        ctypes.CDLL(str(final / lib), mode=ctypes.RTLD_GLOBAL)
    try:
        ctypes.CDLL(str(so))
    except OSError as e:
        raise RuntimeError(f"torchvision's extension still fails to load after stubbing: {e} "
                           f"(originally: {load_error})") from e
    import torchvision
    if not _tv_ops_ok():
        raise RuntimeError("torchvision imported but its native ops are still missing")
    state.update(mode="stubbed", compiled=compiled, lib_dir=str(final), symbols=n)
    # Said once per machine, plainly, when the library is built; every later process only at debug level
    # (with the symbols' count and the words a maintainer looks for).
    if compiled:
        log.info("torchvision %s from PyPI is built for CUDA GPUs and this torch %s for the CPU only; a small "
                 "compatibility library was built once for this machine (%s) so that torchvision's CPU operators "
                 "load. Nothing to do.", torchvision.__version__, torch.__version__, final)
    log.debug("torchvision: %s %d CUDA stub symbols in %s", "compiled" if compiled else "loaded cached", n, final)
    return "stubbed"
