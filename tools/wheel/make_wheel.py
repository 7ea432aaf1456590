"""Packs the precis wheel (the //:wheel genrule runs it with python3; stdlib only).

make_wheel.py OUT.whl --version V --platform TAG FILE...

FILEs are the Python package's sources (their path from torch_ext/ is kept: precis/...)
and the three libraries (placed in precis/, where _lib.py looks first). Writes the
.dist-info files the wheel spec asks for: METADATA, WHEEL and RECORD (sha256 of each).
"""
import argparse
import base64
import hashlib
import os
import re
import subprocess
import sys
import zipfile

REQUIRES = "torch>=2.10"  # the first torch whose stable C ABI the glue uses
LIBRARIES = ("libprecis.so", "libprecis_torch.so", "libprecis_cuda.so", "libprecis_cuda12.so")
# What the libraries may link: glibc's and GCC's runtimes, libgomp (every torch wheel
# ships libgomp.so.1 in torch/lib and loads it before precis) and libprecis.so itself.
ALLOWED_NEEDED = {"libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1",
                  "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1", "libgomp.so.1",
                  "libprecis.so"}
# Fixed timestamp: the same inputs give the same bytes.
DATE = (2020, 1, 1, 0, 0, 0)


def archive_name(path):
    base = os.path.basename(path)
    if base in LIBRARIES:
        return "precis/" + base
    parts = path.replace(os.sep, "/").split("/")
    if "torch_ext" not in parts:
        sys.exit(f"make_wheel: {path} is neither a library nor under torch_ext/")
    return "/".join(parts[parts.index("torch_ext") + 1:])


def check_platform(path, platform):
    """Fails unless the library runs where the manylinux_2_N tag says: no glibc symbol
    newer than 2.N, no shared library outside ALLOWED_NEEDED."""
    floor = tuple(int(x) for x in re.match(r"manylinux_(\d+)_(\d+)_", platform).groups())
    dynamic = subprocess.run(["readelf", "-d", path], capture_output=True, text=True,
                             check=True).stdout
    needed = set(re.findall(r"\(NEEDED\).*\[(.*)\]", dynamic)) - ALLOWED_NEEDED
    if needed:
        sys.exit(f"make_wheel: {path} needs {sorted(needed)}, which the wheel does not carry")
    symbols = subprocess.run(["objdump", "-T", path], capture_output=True, text=True,
                             check=True).stdout
    newest = max((tuple(int(x) for x in v.split(".")[:2])
                  for v in re.findall(r"GLIBC_(\d+\.\d+(?:\.\d+)?)", symbols)), default=(0, 0))
    if newest > floor:
        sys.exit(f"make_wheel: {path} needs glibc {newest[0]}.{newest[1]}, newer than its tag "
                 f"{platform}: raise the tag in WORKSPACE")


def metadata(version):
    return (f"Metadata-Version: 2.1\nName: precis\nVersion: {version}\n"
            "Summary: Precision policies and precision-aware fused Adam for PyTorch "
            "(2.10 or newer), C and CUDA kernels registered through libtorch's stable C ABI\n"
            f"Requires-Python: >=3.10\nRequires-Dist: {REQUIRES}\n")


def record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def write(zf, name, data, executable=False):
    info = zipfile.ZipInfo(name, DATE)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = (0o755 if executable else 0o644) << 16
    zf.writestr(info, data)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--version", required=True)
    ap.add_argument("--platform", required=True)
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    entries = {}
    for path in args.files:
        name = archive_name(path)
        if name in entries:
            sys.exit(f"make_wheel: {name} given twice")
        with open(path, "rb") as f:
            entries[name] = f.read()
        if name.endswith(".so"):
            check_platform(path, args.platform)
    missing = [lib for lib in LIBRARIES if "precis/" + lib not in entries]
    if missing or "precis/__init__.py" not in entries:
        sys.exit(f"make_wheel: missing {missing or 'precis/__init__.py'}")
    # precis.h is the one source of the version: the package must say the same.
    if f'__version__ = "{args.version}"'.encode() not in entries["precis/_lib.py"]:
        sys.exit(f"make_wheel: torch_ext/precis/_lib.py's __version__ is not {args.version} "
                 "(precis.h's PRECIS_VERSION_*)")
    dist = f"precis-{args.version}.dist-info"
    entries[f"{dist}/METADATA"] = metadata(args.version).encode()
    entries[f"{dist}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: precis tools/wheel/make_wheel.py\n"
        f"Root-Is-Purelib: false\nTag: py3-none-{args.platform}\n").encode()
    entries[f"{dist}/top_level.txt"] = b"precis\n"
    record = [record_line(n, d) for n, d in sorted(entries.items())] + [f"{dist}/RECORD,,"]
    with zipfile.ZipFile(args.out, "w") as zf:
        for name in sorted(entries):
            write(zf, name, entries[name], executable=name.endswith(".so"))
        write(zf, f"{dist}/RECORD", ("\n".join(record) + "\n").encode())


if __name__ == "__main__":
    main()
