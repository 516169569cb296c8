"""Regenerate the graph-only ONNX exports used by the tests (needs torch + torchvision).

Same recipe as the shared GoogLeNet/ResNet-50 files: torchvision networks with random init, the
TorchScript exporter, a dynamic batch dimension, and the weights written as external data that is then
deleted, so each file keeps every initializer's name, dtype and dims but no values.
Run: python tests/models/make_models.py OUT_DIR
"""

import os
import sys
import tempfile

import onnx
import torch
import torchvision.models as tvm
from onnx.external_data_helper import convert_model_to_external_data

MODELS = {
    "googlenet": (lambda: tvm.googlenet(weights=None, aux_logits=False, init_weights=False), 224),
    "inception_v3": (lambda: tvm.inception_v3(weights=None, aux_logits=False, init_weights=False), 299),
    "resnet50": (lambda: tvm.resnet50(weights=None), 224),
    "resnext50": (lambda: tvm.resnext50_32x4d(weights=None), 224),
    "densenet121": (lambda: tvm.densenet121(weights=None), 224),
    "mobilenet_v2": (lambda: tvm.mobilenet_v2(weights=None), 224),
    "squeezenet": (lambda: tvm.squeezenet1_0(weights=None), 224),
}


def export(name, train, opset, out_dir):
    make, size = MODELS[name]
    model = make().train(train)
    x = torch.randn(2, 3, size, size)
    suffix = (".train" if train else "") + f".op{opset}"
    path = os.path.join(out_dir, f"{name}{suffix}.onnx")
    with tempfile.TemporaryDirectory() as tmp:
        full = os.path.join(tmp, "m.onnx")
        torch.onnx.export(
            model, x, full, dynamo=False, opset_version=opset, input_names=["input"], output_names=["logits"],
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
            training=torch.onnx.TrainingMode.TRAINING if train else torch.onnx.TrainingMode.EVAL,
            do_constant_folding=not train,
        )
        proto = onnx.load(full)
        convert_model_to_external_data(proto, all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
        onnx.save(proto, os.path.join(tmp, "g.onnx"))
        with open(os.path.join(tmp, "g.onnx"), "rb") as f, open(path, "wb") as g:
            g.write(f.read())
    print("wrote", path, os.path.getsize(path))


if __name__ == "__main__":
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    for name in MODELS:
        for train in (False, True):
            for opset in (13, 17):
                try:
                    export(name, train, opset, out)
                except Exception as e:  # report and go on: one failing export should not hide the others
                    print("FAILED", name, train, opset, type(e).__name__, str(e)[:300])
