"""The Triton interpreter switch (``treeattn_lab.runtime``): every kernel runs whatever was imported first.

Each check runs in a fresh interpreter, since which of ``triton`` and ``treeattn_lab`` comes first is
decided once per process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

TRITON_FIRST = textwrap.dedent("""
    import triton  # first, as transformers and torch.compile do
    import torch

    from treeattn_lab import RolloutTrie, dilated_attention, sparse_attention, tree_attention
    from treeattn_lab.ops.dilated import gated_scan
    from treeattn_lab.patterns.vertical_slash import VerticalSlashPattern

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    pack = RolloutTrie.from_sequences([[1, 2, 3, 4], [1, 2, 5]]).pack().to(dev)
    q = torch.randn(pack.num_tokens, 2, 16, device=dev)
    want = tree_attention(q, q, q, pack, backend="reference")
    torch.testing.assert_close(tree_attention(q, q, q, pack, backend="triton"), want, rtol=1e-4, atol=1e-4)
    x = torch.randn(40, 2, 16, device=dev)
    pattern = VerticalSlashPattern([[0, 3], [5, -1]], [[0], [0]], 16).to(dev)
    torch.testing.assert_close(sparse_attention(x, x, x, pattern, backend="triton"),
                               sparse_attention(x, x, x, pattern, backend="reference"), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dilated_attention(x, x, x, dilation=4, window=3, backend="triton"),
                               dilated_attention(x, x, x, dilation=4, window=3, backend="reference"),
                               rtol=1e-4, atol=1e-4)
    g = torch.rand(40, 3, device=dev)
    torch.testing.assert_close(gated_scan(g, g, backend="triton"), gated_scan(g, g, backend="reference"),
                               rtol=1e-5, atol=1e-5)
    print("every kernel ran")
""")


def _run(code: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**environ, **env})


def test_kernels_run_when_triton_was_imported_first():
    result = _run(TRITON_FIRST)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "every kernel ran" in result.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the interpreter runs only without CUDA")
def test_user_interpret_setting_after_importing_triton_is_honoured():
    # TRITON_INTERPRET=1 set by the user after `import triton`, before treeattn_lab: still interpreted
    code = "import os\nimport triton\nos.environ['TRITON_INTERPRET'] = '1'\n" + TRITON_FIRST.replace(
        "import triton  # first, as transformers and torch.compile do\n", "")
    result = _run(code)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the interpreter runs only without CUDA")
def test_nothing_is_redefined_when_treeattn_lab_comes_first():
    code = textwrap.dedent("""
        import treeattn_lab
        import triton.language as tl
        from treeattn_lab.runtime import reinterpret_triton_language
        from triton.runtime.interpreter import InterpretedFunction
        assert isinstance(tl.cdiv, InterpretedFunction), type(tl.cdiv)
        assert reinterpret_triton_language() == []
        print("ok")
    """)
    result = _run(code)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
