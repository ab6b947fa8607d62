"""Echo: answers each request with max_tokens streamed one-token responses, immediately.

Self-contained (numpy and the Python backend only), so it measures Triton + gRPC + the load
generator and nothing else. The token sent is the prompt's i-th id (cycled), so a client can
check what came back; with `stream` false one response carries all of them, like `baseline`. It
answers with the vLLM-backend contract's output types, sending every output whatever `return_*` says.
"""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy().reshape(-1)


def _max_tokens(request) -> int:
    value = _input(request, "max_tokens")
    if value is not None:
        return int(value[0])
    sampling = _input(request, "sampling_parameters")
    if sampling is not None:
        raw = sampling[0]
        params = json.loads(raw.decode() if isinstance(raw, bytes) else raw or "{}")
        if "max_tokens" in params:
            return int(params["max_tokens"])
    return 16


def _response(ids: list[int], finish_reason: str, n_in: int, n_out: int):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([b"".join(b"x" for _ in ids)], dtype=np.object_)),
        pb_utils.Tensor("output_ids", np.array(ids, dtype=np.int32)),
        pb_utils.Tensor("finish_reason", np.array([finish_reason.encode()], dtype=np.object_)),
        pb_utils.Tensor("num_input_tokens", np.array([n_in], dtype=np.uint32)),
        pb_utils.Tensor("num_output_tokens", np.array([n_out], dtype=np.uint32)),
    ])


class TritonPythonModel:
    def execute(self, requests):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            sender = request.get_response_sender()
            try:
                prompt = _input(request, "input_ids")
                prompt = [0] if prompt is None or prompt.size == 0 else [int(t) for t in prompt]
                n = _max_tokens(request)
                if n < 1:
                    raise ValueError(f"max_tokens must be >= 1, got {n}")
                stream_flag = _input(request, "stream")
                stream = bool(stream_flag[0]) if stream_flag is not None else False
                ids = [prompt[i % len(prompt)] for i in range(n)]
            except Exception as exc:  # a bad request fails alone
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))), flags=final)
                continue
            if not stream:
                sender.send(_response(ids, "length", len(prompt), n), flags=final)
                continue
            # As the vLLM backend's contract has it: "None" until the last response, one token counted each.
            for i in range(n - 1):
                sender.send(_response(ids[i:i + 1], "None", len(prompt), 1))
            sender.send(_response(ids[-1:], "length", len(prompt), 1), flags=final)
        return None
