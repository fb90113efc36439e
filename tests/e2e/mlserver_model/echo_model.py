"""A tiny MLServer model for tests/e2e/test_mlserver.py: answers ``text_input`` with a
fixed text that names it, as ``text_output`` (BYTES). Runs inside .venv-mlserver
(``make mlserver``), imported by MLServer from this folder; the project never imports it."""

from mlserver import MLModel
from mlserver.codecs import StringCodec
from mlserver.types import InferenceRequest, InferenceResponse, ResponseOutput

TEXT_INPUT, TEXT_OUTPUT = "text_input", "text_output"


class EchoModel(MLModel):
    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        prompt = next(
            (StringCodec.decode_input(i)[0] for i in payload.inputs if i.name == TEXT_INPUT), ""
        )
        text = f"mlserver says: {prompt}"
        output = ResponseOutput(
            name=TEXT_OUTPUT, shape=[1], datatype="BYTES", data=[text.encode("utf-8")]
        )
        return InferenceResponse(model_name=self.name, outputs=[output])
