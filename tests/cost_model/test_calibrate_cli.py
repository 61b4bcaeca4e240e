"""`calibrate` on a machine without CUDA fails with one clear error and writes nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gemc.cost_model.calibrate import main, run_calibration
from gemc.cost_model.calibration import CalibrationError


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_needs_a_cuda_gpu(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cal.json"
    with pytest.raises(CalibrationError, match="needs a CUDA GPU"):
        run_calibration(str(out))
    assert main(["--out", str(out)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_module_entry_point(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "gemc.cost_model.calibrate", "--out",
                           str(tmp_path / "c.json"), "--quick"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr
