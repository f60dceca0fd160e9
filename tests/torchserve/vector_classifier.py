"""A TorchServe handler written as TorchServe users write them: BaseHandler's handle, with its own preprocess and
postprocess. Requests are JSON ``{"x": [4 numbers]}``; the ``x-scale`` header multiplies them."""

import torch
from ts.torch_handler.base_handler import BaseHandler

WIDTH = 4


class VectorClassifier(BaseHandler):
    def preprocess(self, data):
        rows = []
        for idx, row in enumerate(data):
            body = row.get("data") or row.get("body")
            values = body.get("x") if isinstance(body, dict) else None
            if not (isinstance(values, list) and len(values) == WIDTH):
                self.context.set_response_status(400, f"expected {{\"x\": [{WIDTH} numbers]}}", idx)
                values = [0.0] * WIDTH
            scale = float(self.context.get_request_header(idx, "x-scale") or 1)
            rows.append([float(value) * scale for value in values])
        self.context.metrics.add_counter("RowsSeen", len(rows))
        return torch.tensor(rows)

    def postprocess(self, data):
        scores = data.softmax(dim=-1)
        return [{"label": int(row.argmax()), "scores": row.tolist()} for row in scores]
