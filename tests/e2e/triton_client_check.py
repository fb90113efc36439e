"""Run stock tritonclient.grpc against a V2 endpoint; print one JSON line of results.

Runs in its own process: tritonclient's generated `inference` protobuf module
cannot share a process with Meridian's (duplicate descriptor symbols).
"""

import json
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient

address = sys.argv[1]
# Optional API key (a fleet with authentication on, e.g. `make up`).
auth = {"authorization": f"Bearer {sys.argv[2]}"} if len(sys.argv) > 2 else {}
client = grpcclient.InferenceServerClient(url=address)
out: dict[str, object] = {
    "live": client.is_server_live(),
    "ready": client.is_server_ready(),
    "model_ready": client.is_model_ready("demo-llm", headers=auth),
    "server_name": client.get_server_metadata().name,
}
meta = client.get_model_metadata("demo-llm", headers=auth)
out["inputs"] = [(t.name, t.datatype) for t in meta.inputs]
out["outputs"] = [(t.name, t.datatype) for t in meta.outputs]


def text_input(prompt: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    return tensor


result = client.infer(
    "demo-llm",
    [text_input("tell me about routers")],
    parameters={"max_tokens": 6},
    headers={"x-meridian-client-geo": "53.35,-6.26", **auth},
)
out["unary_text"] = result.as_numpy("text_output")[0].decode()

responses: "queue.Queue[object]" = queue.Queue()
client.start_stream(
    callback=lambda result, error: responses.put((result, error)),
    headers={"x-meridian-client-geo": "1.35,103.82", **auth},
)
client.async_stream_infer(
    "demo-llm", [text_input("stream this please")], parameters={"max_tokens": 5}
)
tokens, finals, errors = [], [], []
while True:
    result, error = responses.get(timeout=30)
    if error is not None:
        errors.append(str(error))
        break
    tokens.append(result.as_numpy("text_output")[0].decode())
    final = result.get_response().parameters.get("triton_final_response")
    finals.append(bool(final and final.bool_param))
    if finals[-1]:
        break
client.stop_stream()
out["stream_tokens"] = tokens
out["stream_finals"] = finals
out["stream_errors"] = errors
print(json.dumps(out))
