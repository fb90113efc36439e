"""Stream one request with stock tritonclient.grpc, reading slowly; print one JSON line.

Usage: ``triton_slow_reader.py ADDRESS PROMPT MAX_TOKENS REQUEST_ID SLEEP_S``. The stream
callback sleeps ``SLEEP_S`` per response (tritonclient reads the stream in the thread
that calls it, so nothing more is read meanwhile); the channel's HTTP/2 window stays at
its initial 64 KiB (no BDP probing), so the server's writes wait for this reader.
Runs in its own process: tritonclient's generated protobuf modules cannot share one
with Meridian's.
"""

import json
import queue
import sys
import time

import numpy as np
import tritonclient.grpc as grpcclient

address, prompt, max_tokens, request_id, sleep_s = sys.argv[1:6]
client = grpcclient.InferenceServerClient(url=address, channel_args=[("grpc.http2.bdp_probe", 0)])
responses: "queue.Queue[tuple[object, object]]" = queue.Queue()


def slowly(result: object, error: object) -> None:
    responses.put((result, error))
    time.sleep(float(sleep_s))


tensor = grpcclient.InferInput("text_input", [1], "BYTES")
tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
client.start_stream(callback=slowly)
client.async_stream_infer(
    "m", [tensor], request_id=request_id, parameters={"max_tokens": int(max_tokens)}
)
texts, finals, counts, errors = [], [], [], []
while True:
    result, error = responses.get(timeout=30)
    if error is not None:
        errors.append(str(error))
        break
    response = result.get_response()  # type: ignore[attr-defined]
    texts.append(result.as_numpy("text_output")[0].decode())  # type: ignore[attr-defined]
    params = response.parameters
    counts.append([params["prompt_tokens"].int64_param, params["completion_tokens"].int64_param])
    finals.append(bool(params["triton_final_response"].bool_param))
    if finals[-1]:
        break
client.stop_stream()
client.close()
print(json.dumps({"texts": texts, "finals": finals, "counts": counts, "errors": errors}))
