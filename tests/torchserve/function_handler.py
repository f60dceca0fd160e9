"""A TorchServe handler as a module function, the other entry point TorchServe accepts: ``handle(data, context)``,
called once with ``data=None`` to initialise. A request whose body is ``"fail"`` makes it raise
PredictionException(..., 422) for its whole batch."""

import os

import torch
from ts.utils.util import PredictionException

_model = None


def handle(data, context):
    global _model
    if data is None:
        properties = context.system_properties
        path = os.path.join(properties["model_dir"], context.manifest["model"]["serializedFile"])
        _model = torch.jit.load(path).eval()
        return None
    bodies = [row.get("data") or row.get("body") for row in data]
    if "fail" in bodies:
        raise PredictionException("asked to fail", 422)
    with torch.inference_mode():
        scores = _model(torch.tensor([body["x"] for body in bodies], dtype=torch.float32)).softmax(dim=-1)
    return [row.tolist() for row in scores]
