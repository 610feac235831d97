"""benchmarks/chain_audit.py itself: its options (the audits it measures are in
tests/test_chain_audit.py and docs/theory/audit.md)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch


def test_the_audit_script_refuses_cuda_without_cuda_in_one_line(capsys):
    """``benchmarks/chain_audit.py --device cuda`` (the chain on a GPU, for the full and 10× d
    sizes) stops before any work, with one line, where CUDA is not available."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "chain_audit.py"
    main = runpy.run_path(str(path), run_name="chain_audit")["main"]
    with pytest.raises(SystemExit) as exc:
        main(["--quick", "--regimes", "fig5", "--device", "cuda"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("device 'cuda' was requested but CUDA is not available "
                            "(use --device cpu or auto)")
