"""Triton python-backend model: runs the TorchScript file of its version directory on CPU.

Used by CPU servers (the local stack); GPU servers load the same model.pt with the pytorch_libtorch platform and
the same tensor names, so clients do not change.
"""

import json
import os

import torch
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        threads = config.get("parameters", {}).get("torch_num_threads", {}).get("string_value", "1")
        torch.set_num_threads(int(threads))
        path = os.path.join(args["model_repository"], args["model_version"], "model.pt")
        self.model = torch.jit.load(path, map_location="cpu").eval()

    def execute(self, requests):
        responses = []
        for request in requests:
            batch = pb_utils.get_input_tensor_by_name(request, "INPUT__0").as_numpy()
            with torch.inference_mode():
                scores = self.model(torch.from_numpy(batch)).numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT__0", scores)]))
        return responses
