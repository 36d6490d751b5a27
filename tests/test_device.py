"""CPU allocator setting of the worker (``worker.device.reuse_freed_cpu_memory``), checked in child
processes because it changes the whole process."""

import subprocess
import sys

import pytest

ATTENTION_STEPS = """
import resource, sys, torch
if sys.argv[1] == "reuse":
    from worker.device import reuse_freed_cpu_memory
    assert reuse_freed_cpu_memory()
torch.manual_seed(0)
h0 = torch.randn(4, 12, 512, 32, requires_grad=True)  # [batch, heads, max_length 512, head dim]
faults = []
for step in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    h = h0
    for layer in range(3):  # scores, softmax and dropout: 48 MiB tensors, allocated afresh each step
        h = torch.nn.functional.dropout((h @ h.transpose(-1, -2) / 8).softmax(-1), 0.1) @ h
    h.sum().backward()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[3:]))
"""


def page_faults_of_later_steps(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", ATTENTION_STEPS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt: Linux only")
def test_training_steps_reuse_freed_memory_instead_of_faulting_it_in_again():
    default, reuse = page_faults_of_later_steps("default"), page_faults_of_later_steps("reuse")
    assert default > 100_000  # glibc mmaps each tensor over 32 MiB and unmaps it when freed
    assert reuse < default / 10
