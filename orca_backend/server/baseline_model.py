"""The `baseline` model: request-level serving behind Triton's dynamic batcher.

The same engine, weights and kernels as `orca`, in scheduling="request" mode: execute() receives
the batch Triton's dynamic batcher formed, admits it as one batch (`add_requests`), runs it until
its last request finished, and answers each request once. Nobody joins a running batch; that is
the request-level reference ORCA is compared against.
"""

from __future__ import annotations

import queue
from typing import Any

import triton_python_backend_utils as pb_utils

from orca_backend.server.adapter import EngineAdapter, is_cancelled
from orca_backend.server.protocol import (
    EngineUnavailable,
    ParsedRequest,
    ResponseBuilder,
    SamplesResponseBuilder,
    error_response,
    finished_request,
    make_response,
    read_request,
    request_failure,
    response_builder,
)

WAIT_POLL_S = 0.1  # how often a waiting execute() checks engine health and cancellation


class BaselineModel(EngineAdapter):
    """TritonPythonModel for model_repository/baseline (dynamic_batching, max_batch_size > 0)."""

    scheduling = "request"

    def check_triton_config(self) -> None:
        if pb_utils.using_decoupled_model_transaction_policy(self.triton_config):
            raise pb_utils.TritonModelException(f"{self.model_name}: the baseline answers once per request; "
                                                "remove the decoupled transaction policy")
        if int(self.triton_config.get("max_batch_size", 0)) < 1:
            raise pb_utils.TritonModelException(f"{self.model_name}: set max_batch_size >= 1 and dynamic_batching "
                                                "in config.pbtxt; Triton's batcher forms the baseline's batches")

    def check_instance_count(self, count: int) -> None:
        if count != 1:
            raise pb_utils.TritonModelException(
                f"{self.model_name}: the baseline runs one batch at a time on one engine, as a request-level "
                f"server does; set instance_group count 1 (got {count} instances)"
            )

    def owned_engine_fields(self) -> dict[str, Any]:
        # Triton's max_batch_size is the only batch-size knob: the engine must take any batch it forms.
        return {"max_num_seqs": int(self.triton_config["max_batch_size"])}

    def initialize(self, args: dict[str, str]) -> None:
        self._batch_ids = 0
        super().initialize(args)

    def execute(self, requests: list[Any]) -> list[Any]:
        responses: list[Any] = [None] * len(requests)
        parsed: dict[int, ParsedRequest] = {}
        prompts: dict[int, list[int]] = {}  # each request's prompt ids, tokenized once
        builders: dict[int, ResponseBuilder | SamplesResponseBuilder] = {}
        for index, request in enumerate(requests):
            try:
                parsed[index] = read_request(request, self.engine.config, batched=True)
                prompts[index] = self.engine.prompt_ids(parsed[index].prompt)
                # One answer per request: `stream` cannot apply, so it holds everything.
                builders[index] = response_builder(parsed[index], prompts[index], self.tokenizer, stream=False,
                                                   batched=True)  # fmt: skip
            except Exception as exc:  # this request alone fails; the rest of the batch runs
                responses[index] = error_response(exc)
                parsed.pop(index, None)
        if parsed:
            self._run_batch(requests, parsed, prompts, builders, responses)
        return responses

    def _run_batch(self, requests: list[Any], parsed: dict[int, ParsedRequest], prompts: dict[int, list[int]],
                   builders: dict[int, ResponseBuilder | SamplesResponseBuilder], responses: list[Any]) -> None:
        self._batch_ids += 1
        ids = {index: f"batch{self._batch_ids}-{index}" for index in parsed}
        index_of = {request_id: index for index, request_id in ids.items()}
        admitted = self._admit(parsed, prompts, responses)
        events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        if admitted:
            try:
                self.engine.add_requests([prompts[i] for i in admitted], [parsed[i].params for i in admitted],
                                         request_ids=[ids[i] for i in admitted], on_output=events.put,
                                         priority=[parsed[i].priority for i in admitted],
                                         timeout_s=[parsed[i].timeout_s for i in admitted],
                                         pooling=[parsed[i].pooling for i in admitted])  # fmt: skip
            except Exception as exc:
                for index in admitted:
                    responses[index] = error_response(exc)
                return
        remaining = set(admitted)
        cancelled: set[int] = set()
        while remaining:
            try:
                event = events.get(timeout=WAIT_POLL_S)
            except queue.Empty:
                if not self.engine.healthy:
                    for index in remaining:
                        responses[index] = error_response(EngineUnavailable(self.engine_stopped_message("reload the model")))
                    return
                for index in remaining - cancelled:
                    if is_cancelled(requests[index]):
                        cancelled.add(index)
                        self.engine.abort_request(ids[index])
                continue
            index = index_of[event.request_id]
            builder = builders[index]
            builder.add(event)
            if builder.finished:  # with n > 1, every sample has
                remaining.discard(index)
                self.metrics.request_finished(finished_request(builder))
                try:
                    if builder.error is not None:
                        failure = request_failure(builder.error, self.engine.healthy, builder.finish_reason)
                        responses[index] = error_response(failure)
                    else:
                        responses[index] = make_response(builder.flush())
                except Exception as exc:  # this request alone fails; the batch's others are answered
                    responses[index] = error_response(exc)

    def _admit(self, parsed: dict[int, ParsedRequest], prompts: dict[int, list[int]], responses: list[Any]) -> list[int]:
        """The requests the engine accepts; the others get their validation error."""
        if not self.engine.healthy:
            for index in parsed:
                responses[index] = error_response(EngineUnavailable(self.engine_stopped_message("reload the model")))
            return []
        admitted = []
        for index, request in parsed.items():
            try:
                # add_requests() is all-or-none and does not say which request was bad: check each first.
                self.engine.validate(prompts[index], request.params)
                if request.pooling is not None:
                    self.engine.check_pooling(request.pooling)
                admitted.append(index)
            except ValueError as exc:
                responses[index] = error_response(exc)
        return admitted
