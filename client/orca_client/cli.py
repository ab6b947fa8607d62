"""`orca-client`: stream one prompt from the `orca` (or `baseline`) model over gRPC.

Tokens print as they arrive. Requests and responses go through `orca_client.protocol`, the one
client-side encoding of the request/response contract (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import queue
import sys
import time
from collections.abc import Iterator
from typing import Any

from orca_client import protocol


def stream_one(client: Any, model: str, inputs: list[Any],
               timeout_s: float = 600.0) -> Iterator[protocol.Delta]:
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
            delta = protocol.decode_response(result)
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
    p.add_argument("--include-input", action="store_true",
                   help="echo the prompt in the output (with --no-stream: the contract refuses it in a stream)")
    p.add_argument("--no-stream", action="store_true", help="one response at the end")
    p.add_argument("--ids", action="store_true", help="print token ids instead of text")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (args.prompt is None) == (args.input_ids is None):
        print("orca-client: give a prompt or --input-ids (exactly one)", file=sys.stderr)
        return 2
    if args.include_input and not args.no_stream:
        print("orca-client: --include-input needs --no-stream (a stream never echoes the prompt)", file=sys.stderr)
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
        inputs = protocol.build_inputs(
            text=args.prompt, input_ids=ids, max_tokens=args.max_tokens, sampling=sampling,
            stream=not args.no_stream, exclude_input_in_output=not args.include_input,
            return_outputs=protocol.STATUS_OUTPUTS,
            batched=protocol.is_batched(protocol.get_model_config(client, args.model)),
        )
        start = time.perf_counter()
        first = last = None
        generated = 0
        for delta in stream_one(client, args.model, inputs):
            first = first or delta
            last = delta
            generated += delta.num_output_tokens
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
            f"\n[{last.finish_reason}] {last.num_input_tokens} input tokens, {generated} output tokens; "
            f"first response {1000 * (first.time - start):.1f} ms, total {1000 * total:.1f} ms",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
