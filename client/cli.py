"""`orca-client`: stream one prompt from the `orca` (or `baseline`) model over gRPC.

Tokens print as they arrive. The helpers (`build_inputs`, `is_batched`, `response_fields`) hold
the client side of DESIGN.md's contract, so tests and other clients build requests one way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def is_batched(client: Any, model: str) -> bool:
    """Whether `model` has Triton's implicit batch dimension (baseline: yes, orca: no)."""
    config = client.get_model_config(model, as_json=True)
    config = config.get("config", config)
    return int(config.get("max_batch_size", 0)) > 0


def build_inputs(
    *,
    text: str | None = None,
    input_ids: list[int] | None = None,
    max_tokens: int | None = None,
    sampling: dict[str, Any] | str | None = None,
    stream: bool | None = None,
    exclude_input_in_output: bool | None = None,
    batched: bool = False,
    module: Any = None,
) -> list[Any]:
    """InferInputs for one request; `module` is tritonclient.grpc (default) or tritonclient.http.

    `sampling` is a dict (sent as JSON) or a string sent verbatim as `sampling_parameters`.
    """
    if module is None:
        import tritonclient.grpc as module
    arrays: list[tuple[str, np.ndarray, str]] = []
    if text is not None:
        arrays.append(("text_input", np.array([text.encode("utf-8")], dtype=np.object_), "BYTES"))
    if input_ids is not None:
        arrays.append(("input_ids", np.array(input_ids, dtype=np.int32), "INT32"))
    if max_tokens is not None:
        arrays.append(("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"))
    if sampling:
        payload = sampling if isinstance(sampling, str) else json.dumps(sampling)
        arrays.append(("sampling_parameters", np.array([payload.encode()], dtype=np.object_), "BYTES"))
    if stream is not None:
        arrays.append(("stream", np.array([stream], dtype=np.bool_), "BOOL"))
    if exclude_input_in_output is not None:
        arrays.append(("exclude_input_in_output", np.array([exclude_input_in_output], dtype=np.bool_), "BOOL"))
    inputs = []
    for name, value, dtype in arrays:
        if batched:
            value = value[np.newaxis, ...]
        tensor = module.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


@dataclass
class Delta:
    """The fields of one response, batch dimension removed."""

    text: str
    ids: list[int]
    finish_reason: str
    num_input_tokens: int
    num_output_tokens: int
    final: bool
    time: float = field(default_factory=time.perf_counter)


def response_fields(result: Any) -> Delta:
    """Reads an InferResult of either model into a Delta."""

    def get(name: str) -> np.ndarray | None:
        value = result.as_numpy(name)
        return None if value is None else value.reshape(-1)

    text = get("text_output")
    ids = get("output_ids")
    reason = get("finish_reason")
    n_in = get("num_input_tokens")
    n_out = get("num_output_tokens")
    finish = reason[0].decode() if reason is not None and reason.size else ""
    final = bool(finish)
    with contextlib.suppress(AttributeError, KeyError, TypeError):
        # Set on the final response of a decoupled stream with enable_empty_final_response.
        final = final or result.get_response().parameters["triton_final_response"].bool_param
    return Delta(
        text=b"".join(text).decode("utf-8") if text is not None else "",
        ids=[int(t) for t in ids] if ids is not None else [],
        finish_reason=finish,
        num_input_tokens=int(n_in[0]) if n_in is not None and n_in.size else 0,
        num_output_tokens=int(n_out[0]) if n_out is not None and n_out.size else 0,
        final=final,
    )


def stream_one(client: Any, model: str, inputs: list[Any], timeout_s: float = 600.0):
    """Yields the Deltas of one streamed request as they arrive; raises on an error response."""
    responses: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        deadline = time.monotonic() + timeout_s
        while True:
            result, error = responses.get(timeout=max(0.0, deadline - time.monotonic()))
            if error is not None:
                raise RuntimeError(str(error))
            delta = response_fields(result)
            if delta.final and not (delta.ids or delta.text or delta.finish_reason):
                return  # the empty final response
            yield delta
            if delta.final:
                return
    finally:
        client.stop_stream()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orca-client", description=__doc__.splitlines()[0])
    p.add_argument("prompt", nargs="?", help="prompt text (needs a model with a tokenizer)")
    p.add_argument("--input-ids", help="prompt as comma-separated token ids instead of text")
    p.add_argument("--model", default="orca", help="orca (iteration-level) or baseline (dynamic batcher)")
    p.add_argument("--url", default="127.0.0.1:8001", help="Triton gRPC endpoint")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--min-tokens", type=int)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--include-input", action="store_true", help="echo the prompt in the output")
    p.add_argument("--no-stream", action="store_true", help="one response at the end")
    p.add_argument("--ids", action="store_true", help="print token ids instead of text")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (args.prompt is None) == (args.input_ids is None):
        print("orca-client: give a prompt or --input-ids (exactly one)", file=sys.stderr)
        return 2
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    sampling: dict[str, Any] = {"temperature": args.temperature}
    for key in ("min_tokens", "top_p", "top_k", "seed", "stop"):
        if getattr(args, key) is not None:
            sampling[key] = getattr(args, key)
    if args.ignore_eos:
        sampling["ignore_eos"] = True
    try:
        ids = [int(t) for t in args.input_ids.split(",")] if args.input_ids else None
    except ValueError:
        print("orca-client: --input-ids takes comma-separated integers", file=sys.stderr)
        return 2
    client = grpcclient.InferenceServerClient(args.url)
    try:
        inputs = build_inputs(
            text=args.prompt, input_ids=ids, max_tokens=args.max_tokens, sampling=sampling,
            stream=not args.no_stream, exclude_input_in_output=not args.include_input,
            batched=is_batched(client, args.model),
        )
        start = time.perf_counter()
        first = last = None
        for delta in stream_one(client, args.model, inputs):
            first = first or delta
            last = delta
            piece = " ".join(map(str, delta.ids)) + (" " if delta.ids else "") if args.ids else delta.text
            sys.stdout.write(piece)
            sys.stdout.flush()
    except (InferenceServerException, RuntimeError) as exc:
        print(f"\norca-client: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if last is not None and first is not None:
        total = last.time - start
        print(
            f"\n[{last.finish_reason}] {last.num_input_tokens} input tokens, {last.num_output_tokens} output tokens; "
            f"first response {1000 * (first.time - start):.1f} ms, total {1000 * total:.1f} ms",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
