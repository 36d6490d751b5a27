"""``tunejob doctor``: the report and exit status on the CPU, and its CUDA-graph verdict driven on
the CPU (where "capture" keeps the step's bodies), with and without an injected mismatch."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.test_steps import empty_graph_cache  # noqa: F401 (autouse: each test starts with no cached graphs)
from worker import doctor
from worker.training import capture as capturing
from worker.training import recipe

CPU = torch.device("cpu")


def test_doctor_on_the_cpu_reports_and_exits_0():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEJOB_")} | {"TUNEJOB_DEVICE": "cpu"}
    done = subprocess.run(
        [sys.executable, "-m", "tunejob", "doctor", "--json"], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"] and checks["environment"]["figures"]["torch"] == torch.__version__
    assert checks["environment"]["figures"]["free_memory_mib"] > 0
    assert checks["environment"]["figures"]["amx"] is torch.cpu._is_amx_tile_supported()
    # no TUNEJOB_CPU_BF16 here: auto follows the CPU
    assert checks["environment"]["figures"]["precision_auto"] == (
        "bf16" if torch.cpu._is_amx_tile_supported() else "fp32"
    )
    assert checks["eager_training"]["ok"] and checks["eager_training"]["figures"]["tokens_per_second"] > 0
    assert checks["cuda_graphs"]["ok"] is None and "does not apply" in checks["cuda_graphs"]["detail"]


@pytest.mark.parametrize("mismatch", [False, True])
def test_the_graph_check_passes_a_faithful_capture_and_fails_a_wrong_one(engine_env, models_dir, monkeypatch, mismatch):
    monkeypatch.setattr(doctor, "MODEL_NAME", "tiny-bert")  # engine_env's models directory has it
    from shared.settings import get_settings

    # "capture" on the CPU, where TUNEJOB_CUDA_GRAPHS (which the doctor turns off for its eager run) allows it
    monkeypatch.setattr(recipe, "eager_reason", lambda *args: None if get_settings().cuda_graphs else "graphs off")
    if mismatch:
        original = capturing.CapturedSteps._capture

        def update_not_replayed(self, body, warm_up):
            replay = original(self, body, warm_up)
            return (lambda: None) if body == self.update else replay

        monkeypatch.setattr(capturing.CapturedSteps, "_capture", update_not_replayed)
    eager, captured = doctor.training_checks(CPU, graphs=True, steps=4, batch_size=8, max_length=32)
    assert eager.ok
    assert captured.ok is (not mismatch)
    assert ("does not match the eager step" if mismatch else "checked against eager steps") in captured.detail
