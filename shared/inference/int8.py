"""``precision: "int8"`` on the CPU: the model's ``nn.Linear`` layers in int8.

Two ways, one chosen per CPU (their speed and agreement with fp32: docs/benchmarks.md):

- **Compiled** (CPUs with AMX, ``shared.inference.precision.cpu_has_amx``): torchao's PT2E dynamic
  int8 quantization (``X86InductorQuantizer``: weights int8 per channel, activations quantized per
  batch) of the model exported with a dynamic number of rows and width (``torch.export``), compiled
  by inductor (``torch.compile(dynamic=True)``: one compile serves every batch shape) and run under
  bf16 autocast, so that the float ops between the int8 products (attention, GELU) use AMX-BF16 too
  ("int8-mixed-bf16", torchao's "PyTorch 2 Export Quantization with X86 Backend through Inductor"
  tutorial). It needs a C++ compiler at run time: where export, quantization or a compiled batch fails, the
  eager way is used and ``Int8Model.fallback`` says why.
- **Eager** (every other CPU, and the fallback): ``torch.ao.quantization.quantize_dynamic`` of every
  ``nn.Linear`` (PyTorch docs, "Dynamic Quantization").
"""

import copy
import logging
from types import SimpleNamespace

import torch

from shared.inference.precision import cpu_has_amx

log = logging.getLogger(__name__)


def eager_int8(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with every ``nn.Linear`` dynamically quantized to int8."""
    return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


class Int8Model(torch.nn.Module):
    """A sequence-classification model in int8, called like the model (``input_ids``,
    ``attention_mask``, ``token_type_ids`` of shape ``[rows, width]``) and answering an object with
    ``logits`` (``[rows, labels]``, float). ``way`` is ``"compiled"`` or ``"eager"``; ``fallback``
    why a compiled model was not used (None if it was, or if the CPU has no AMX)."""

    def __init__(self, model: torch.nn.Module, example: dict[str, torch.Tensor], max_width: int):
        super().__init__()
        self.eager, self.compiled = eager_int8(model), None
        self.fallback: str | None = None
        if cpu_has_amx():
            try:
                self.compiled = compiled_int8(model, example, max_width)
                with torch.inference_mode():  # inputs made as the prediction loop makes them, or it compiles again
                    self.compiled(**{name: tensor.clone() for name, tensor in example.items()})  # compiles now
            except Exception as e:  # no C++ compiler, an op export or inductor cannot take, ...
                self.fail(e)

    @property
    def way(self) -> str:
        return "compiled" if self.compiled is not None else "eager"

    def fail(self, error: Exception) -> None:
        self.compiled, self.fallback = None, f"{type(error).__name__}: {str(error)[:300]}"
        log.warning("int8: the compiled model failed (%s); using eager dynamic quantization", self.fallback)

    def forward(self, **batch: torch.Tensor) -> SimpleNamespace:
        if self.compiled is not None:
            try:
                return SimpleNamespace(logits=self.compiled(**batch).float())
            except Exception as e:
                self.fail(e)
        return SimpleNamespace(logits=self.eager(**batch).logits)


def compiled_int8(model: torch.nn.Module, example: dict[str, torch.Tensor], max_width: int):
    """``model`` (its inputs as in ``example``, ``[rows, width]`` each) exported with dynamic rows
    and width (2 to ``max_width``), quantized by torchao's PT2E (dynamic int8,
    ``X86InductorQuantizer``) and compiled by inductor; returns a function of the same inputs that
    answers the logits, running under bf16 autocast."""
    import torch._inductor.config
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    torch._inductor.config.freezing = True  # folds the int8 weights into the compiled kernels
    rows, width = torch.export.Dim("rows", min=1), torch.export.Dim("width", min=2, max=max_width)
    logits_of = LogitsOf(copy.deepcopy(model))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        exported = torch.export.export(
            logits_of, (), example, strict=False, dynamic_shapes={name: {0: rows, 1: width} for name in example}
        ).module()
        quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config(is_dynamic=True))
        prepared = prepare_pt2e(exported, quantizer)
        prepared(**example)
        compiled = torch.compile(convert_pt2e(prepared), dynamic=True)

    def run(**batch: torch.Tensor) -> torch.Tensor:
        # inference_mode as in the prediction loop (shared.inference.loop.run_batches): tensors made
        # outside it carry other dispatch keys, and a call with those would compile again
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            return compiled(**batch)

    return run


class LogitsOf(torch.nn.Module):
    """``model``'s ``logits`` alone (a tensor, which export keeps as the graph's one output)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).logits
